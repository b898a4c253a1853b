"""The checks that need several requests at once: a hang-up frees its slot, and slow readers
do not pace other streams.

A slot's state is read from the server's own gauges, whatever it calls them: vLLM's and
nanoserve's `*:num_requests_running` and llama.cpp's `llamacpp:requests_processing` on
/metrics, else llama.cpp's /slots (`is_processing`). A server with neither is `unsupported`
for the hang-up check.

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
import re
import socket
from typing import Any
from urllib.parse import urlsplit

import trio

from sim.stats import percentile
from sim.target import answer, wire
from sim.target.outcome import Outcome
from sim.target.target import COMPLETIONS, Target

_RUNNING = re.compile(r"^([a-zA-Z_:][\w:]*(?:num_requests_running|requests_processing))"
                      r"(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$")
LONG_PROMPT = "Count from 1 to 10000, one number a line: 1\n2\n3\n"


async def running(t: Target) -> int | None:
    """Requests the server says are running now; None where it exports no such figure."""
    status, _, text = await wire.get(t.client, t.url, "/metrics")
    if status == 200:
        values = [float(m.group(2)) for line in text.splitlines()
                  if (m := _RUNNING.match(line.strip()))]
        if values:
            return int(sum(values))
    status, obj, _ = await wire.get(t.client, t.url, "/slots")
    if status == 200 and isinstance(obj, list):
        return sum(1 for s in obj if isinstance(s, dict) and s.get("is_processing"))
    return None


async def settle(t: Target, want: int = 0) -> tuple[float | None, list[int | None]]:
    """Poll the gauge until it is at most `want`: the seconds it took (None: not within
    settle_s) and the values read."""
    start = trio.current_time()
    seen: list[int | None] = []
    while trio.current_time() - start < t.settle_s:
        n = await running(t)
        seen.append(n)
        if n is not None and n <= want:
            return trio.current_time() - start, seen
        await trio.sleep(0.05)
    return None, seen


def long_body(t: Target, stream: bool = True) -> dict[str, Any]:
    """A request that runs for a long while: many tokens, the end-of-text token ignored
    (vLLM's, llama.cpp's and nanoserve's `ignore_eos`)."""
    return t.body(COMPLETIONS, LONG_PROMPT, max_tokens=2048, ignore_eos=True, stream=stream)


async def hangup_frees_slot(t: Target) -> Outcome:
    """A long stream runs (the gauge counts it), its client closes the connection, and the
    gauge is back to 0 within settle_s."""
    name = "hang-up frees its slot"
    if await running(t) is None:
        if t.slots is None:
            return Outcome(name, "unsupported", "no running-requests gauge (/metrics, /slots); "
                           "--slots N measures by queueing instead")
        return await _hangups_by_queueing(t, name, t.slots)
    if (await settle(t))[0] is None:
        return Outcome(name, "unsupported", f"the server was not idle within {t.settle_s} s")
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_eager_reader, t, long_body(t), stop)
        counted = await _started(t, 1)
        stop.set()  # the hang-up
    if not counted:
        return Outcome(name, "unsupported", "the gauge never counted the long request")
    took, values = await settle(t)
    if took is None:
        return Outcome(name, "fail", f"still running {t.settle_s} s after the client left",
                       ({"request": long_body(t), "running": values[-20:]},))
    return Outcome(name, "pass", f"the running gauge back to 0 {took:.2f} s after the hang-up")


async def _hangups_by_queueing(t: Target, name: str, slots: int) -> Outcome:
    """Without a gauge: fill the server's `slots` with long streams, hang them all up, and
    time a one-token request sent just after. A server that frees the slots starts it at
    once; one that keeps generating starts it only when the long streams end."""
    short = t.body(COMPLETIONS, "Hello", max_tokens=1, stream=True)
    alone = await _first_frame_s(t, short)
    if alone is None:
        return Outcome(name, "unsupported", "a one-token stream got no frame")
    started = [trio.Event() for _ in range(slots)]
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        for ev in started:
            nursery.start_soon(_held, t, long_body(t), ev, stop)
        with trio.move_on_after(t.settle_s):
            for ev in started:
                await ev.wait()
        stop.set()  # every long stream hangs up
    behind = None
    with trio.move_on_after(t.settle_s):
        behind = await _first_frame_s(t, short)
    if behind is None:
        return Outcome(name, "fail", f"a request sent after {slots} hang-ups did not start "
                       f"within {t.settle_s} s (alone: {alone:.2f} s)",
                       ({"request": long_body(t), "slots": slots},))
    return Outcome(name, "pass", f"a request sent after {slots} hang-ups started in "
                   f"{behind:.2f} s ({alone:.2f} s alone; no gauge, --slots {slots})")


async def _first_frame_s(t: Target, body: dict[str, Any]) -> float | None:
    seen = await t.send(COMPLETIONS, body, hangup_after_frames=1)
    return seen.frames[0].t if seen.status == 200 and seen.frames else None


async def _held(t: Target, body: dict[str, Any], started: trio.Event, stop: trio.Event) -> None:
    """A long stream read eagerly; `started` once its first bytes arrive; closed at `stop`."""
    async def read() -> None:
        async with t.client.stream("POST", t.url + COMPLETIONS, json=body) as resp:
            async for _ in resp.aiter_bytes():
                started.set()

    async with trio.open_nursery() as inner:
        inner.start_soon(read)
        await stop.wait()
        inner.cancel_scope.cancel()


async def _slow_reader(t: Target, body: dict[str, Any], stop: trio.Event) -> None:
    """Send `body` on a socket with a small receive buffer, read nothing, close at `stop`."""
    parts = urlsplit(t.url)
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    raw = json.dumps(body).encode()
    head = (f"POST {parts.path.rstrip('/')}{COMPLETIONS} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n")
    with sock:
        await sock.connect((parts.hostname or "127.0.0.1", parts.port or 80))
        await sock.send(head.encode() + raw)
        await stop.wait()


async def _eager_reader(t: Target, body: dict[str, Any], stop: trio.Event) -> None:
    async with trio.open_nursery() as inner:
        inner.start_soon(t.send, COMPLETIONS, body)
        await stop.wait()
        inner.cancel_scope.cancel()  # closes the stream: a hang-up


async def _fast_beside(t: Target, slow: bool, n: int = 8) -> tuple[list[float] | None, Any]:
    """Inter-token gaps of 64-token streams run one after another for window_s beside `n`
    long streams read slowly or eagerly; None (and the evidence) where one of them did not
    finish within phase_timeout_s."""
    stop = trio.Event()
    gaps: list[float] = []
    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(_slow_reader if slow else _eager_reader, t, long_body(t), stop)
        await _started(t, n)
        end = trio.current_time() + t.window_s
        while trio.current_time() < end:
            seen = None
            with trio.move_on_after(t.phase_timeout_s):
                seen = await t.send(COMPLETIONS, t.body(
                    COMPLETIONS, LONG_PROMPT, max_tokens=64, ignore_eos=True, stream=True))
            if seen is None or not answer.read(seen).finish_reason():
                stop.set()
                return None, seen.evidence() if seen is not None else "no answer"
            times = [f.t for f in seen.frames
                     if any(answer.delta_text(c) for c in (f.obj or {}).get("choices") or [])]
            gaps += [b - a for a, b in zip(times, times[1:], strict=False)]
        stop.set()
    await settle(t)
    return gaps or None, None


async def _started(t: Target, n: int) -> bool:
    """Wait until `n` requests run, by the gauge where there is one (False: not within
    settle_s), else for two seconds."""
    if await running(t) is None:
        await trio.sleep(2.0)
        return True
    with trio.move_on_after(t.settle_s):
        while True:  # polling: the gauge is the other server's, no event to wait on
            if (await running(t) or 0) >= n:
                return True
            await trio.sleep(0.05)
    return False


async def slow_readers(t: Target) -> Outcome:
    """A fast stream's inter-token latency beside eight slow readers, against the same beside
    eight eager readers (the same batch on the server): a slow reader must not pace it."""
    name = "slow readers don't pace"
    eager, _ = await _fast_beside(t, slow=False)
    paced, evidence = await _fast_beside(t, slow=True)
    if eager is None:
        return Outcome(name, "unsupported", "a stream beside eight eager readers did not "
                       f"finish within {t.phase_timeout_s} s")
    e50, e90 = percentile(eager, 50), percentile(eager, 90)
    if paced is None:
        return Outcome(name, "fail", "beside eight slow readers a 64-token stream did not "
                       f"finish within {t.phase_timeout_s} s (eager: ITL p50 {e50 * 1e3:.0f}"
                       " ms)", ({"fast_stream": evidence},))
    p50, p90 = percentile(paced, 50), percentile(paced, 90)
    detail = (f"ITL p50/p90 {p50 * 1e3:.0f}/{p90 * 1e3:.0f} ms beside slow readers, "
              f"{e50 * 1e3:.0f}/{e90 * 1e3:.0f} ms beside eager ones")
    # Twice the eager figure and 20 ms: a shared host's noise, not a paced batch, which
    # stalls for as long as the slow readers do not read.
    ok = p50 <= 2 * e50 + 0.02 and p90 <= 2 * e90 + 0.02
    return Outcome(name, "pass" if ok else "fail", detail,
                   () if ok else ({"fast_stream": evidence},))
