"""Slow readers do not pace other streams: a fast stream's inter-token latency beside eight
readers that read nothing, against the same beside eight that read eagerly (the same batch
on the server).

A slow reader here is a socket that sends its request and then reads nothing, with a small
receive buffer and a 536-byte segment size (TCP_MAXSEG, the smallest every stack takes). On
loopback, where segments are 64 KB, the server's kernel would otherwise buffer about 3 MB
for a reader that never reads (4 MB send buffers, measured on Linux 6); at 536 bytes it
buffers about 135 KB, so a server that waits on its writes is held up after about a
thousand frames. The fast side runs 64-token streams back to back for `window_s`, so that
the slow readers' buffers fill while it is measured.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import trio

from sim.stats import percentile
from sim.target import answer, wire
from sim.target.load import eager_reader, long_body, settle, started
from sim.target.outcome import Outcome
from sim.target.target import COMPLETIONS, Target

NAME = "slow readers don't pace"


@dataclass
class Phase:
    gaps: list[float]
    stalled: Any = None  # the evidence of a fast stream that did not finish
    unsupported: str | None = None


async def slow_readers(t: Target) -> Outcome:
    parts = urlsplit(t.url)
    if parts.scheme != "http":
        return Outcome(NAME, "unsupported", f"slow readers speak plain HTTP, not {parts.scheme}")
    eager = await _fast_beside(t, slow=False)
    if eager.unsupported or not eager.gaps:
        return Outcome(NAME, "unsupported", eager.unsupported or "a stream beside eight eager "
                       f"readers did not finish within {t.phase_timeout_s} s")
    paced = await _fast_beside(t, slow=True)
    if paced.unsupported:
        return Outcome(NAME, "unsupported", paced.unsupported)
    e50, e90 = percentile(eager.gaps, 50), percentile(eager.gaps, 90)
    if not paced.gaps:
        return Outcome(NAME, "fail", "beside eight slow readers a 64-token stream did not "
                       f"finish within {t.phase_timeout_s} s (eager: ITL p50 {e50 * 1e3:.0f}"
                       " ms)", ({"fast_stream": paced.stalled},))
    p50, p90 = percentile(paced.gaps, 50), percentile(paced.gaps, 90)
    detail = (f"ITL p50/p90 {p50 * 1e3:.0f}/{p90 * 1e3:.0f} ms beside slow readers, "
              f"{e50 * 1e3:.0f}/{e90 * 1e3:.0f} ms beside eager ones")
    # Twice the eager figure and 20 ms: a shared host's noise, not a paced batch, which
    # stalls for as long as the slow readers do not read.
    ok = p50 <= 2 * e50 + 0.02 and p90 <= 2 * e90 + 0.02
    gaps = {"beside_slow_ms": [round(g * 1e3, 1) for g in paced.gaps[:64]],
            "beside_eager_ms": [round(g * 1e3, 1) for g in eager.gaps[:64]]}
    return Outcome(NAME, "pass" if ok else "fail", detail, () if ok else (gaps,))


async def _fast_beside(t: Target, slow: bool, n: int = 8) -> Phase:
    """Inter-token gaps of 64-token streams run one after another for window_s beside `n`
    long streams read slowly or eagerly."""
    stop = trio.Event()
    phase = Phase([])
    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(_slow_reader if slow else eager_reader, t, long_body(t), stop)
        if not await started(t, n):
            phase.unsupported = f"the {n} {'slow' if slow else 'eager'} readers' requests " \
                                "did not all run"
        end = trio.current_time() + t.window_s
        while phase.unsupported is None and trio.current_time() < end:
            await _one_fast(t, phase)
            if phase.stalled is not None:
                break
        stop.set()
    await settle(t)
    return phase


async def _one_fast(t: Target, phase: Phase) -> None:
    seen = None
    with trio.move_on_after(t.phase_timeout_s):
        seen = await t.send(COMPLETIONS, t.body(COMPLETIONS, "Count to ten:", max_tokens=64,
                                                ignore_eos=True, stream=True))
    if seen is not None and seen.status != 200:
        phase.unsupported = f"the fast stream got status {seen.status}"
    elif seen is None or not answer.read(seen).finish_reason():
        phase.gaps = []
        phase.stalled = seen.evidence() if seen is not None else "no answer"
    else:
        times = [f.t for f in seen.frames if answer.frame_text(f.obj)]
        phase.gaps += [b - a for a, b in zip(times, times[1:], strict=False)]


async def _slow_reader(t: Target, body: dict[str, Any], stop: trio.Event) -> None:
    await silent_reader(t, COMPLETIONS, json.dumps(body).encode(), stop)


async def silent_reader(t: Target, path: str, raw: bytes, stop: trio.Event) -> None:
    """POST `raw` on a socket with a small receive buffer, read nothing, close at `stop`.
    A refused or reset connection just ends it (the phase then finds fewer running)."""
    parts = urlsplit(t.url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    auth = "".join(f"{k}: {v}\r\n" for k, v in wire.auth_headers(t.api_key).items())
    head = (f"POST {parts.path.rstrip('/')}{path} HTTP/1.1\r\nHost: {parts.netloc}\r\n{auth}"
            f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n")
    try:
        family, kind, proto, _, addr = (await trio.socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM))[0]
        sock = trio.socket.socket(family, kind, proto)
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
            await sock.connect(addr)
            await sock.send(head.encode() + raw)
            await stop.wait()
    except OSError:
        return
