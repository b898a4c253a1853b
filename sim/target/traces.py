"""A trace's client behaviour replayed at a server we do not control, and what a client can
check of the answers.

There is no step clock on the other side, so steps become seconds: a request `at_step` k is
sent k * `step_s` after the start, a hang-up `at_step` k happens then, a reader that takes
a frame every n steps waits n * `step_s` after each, and a recorded pattern
(`frames_by_step`) takes frame k + 1 no earlier than its step. A reader that never reads
sends its request on a socket that takes nothing, closed at its hang-up or when the rest
have ended. A virtual-clock trace's seconds are used as they are. Requests that stall their
body (`send_body_bytes`) need a server body timeout; they are skipped and counted. Faults a
header injects are nanoserve's own (wrappers around its model), so such a trace is refused.

The checks:
- no server errors: every request got an HTTP status under 500 and a whole answer, unless
  its client hung up;
- frames: no stream frame says nothing (checks.empty_frame) or holds a lone surrogate;
- stream = unary: every deterministic request (temperature 0, or a seed) that ran to its
  end is sent again with `stream` flipped, alone, and each choice's text must be the same;
- hang-ups: where the trace hangs up (or never reads) and the server has a running-requests
  gauge, it is back to 0 within settle_s of the last answer (before the twins run).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import trio

from sim.target import answer, checks, load, pacing
from sim.target.outcome import Outcome, verdict
from sim.target.target import Target
from sim.target.wire import Seen
from sim.trace.format import EverySeconds, EverySteps, FramesByStep, Trace, TraceRequest


def unsupported(trace: Trace) -> str | None:
    """Why this trace cannot be replayed at another server; None where it can."""
    if trace.header.faults:
        return "it injects faults into nanoserve's own model (header `faults`)"
    return None


async def replay_at(t: Target, trace: Trace, step_s: float) -> list[Outcome]:
    """The trace's requests sent as its clients behaved, then its checks' outcomes."""
    seen: dict[str, Seen] = {}
    skipped = [r.id for r in trace.requests if r.client.send_body_bytes is not None]
    others_done = trio.Event()  # when a reader that never reads may close, at the latest
    async with trio.open_nursery() as outer:
        async with trio.open_nursery() as nursery:
            start = trio.current_time()
            for req in trace.requests:
                if req.id in skipped:
                    continue
                silent = req.client.read == "never"
                (outer if silent else nursery).start_soon(
                    _silent if silent else _one, t, req, start, step_s, seen, others_done)
        others_done.set()
    label = f"{len(seen)} requests" + (f" ({len(skipped)} stalled-body skipped)"
                                       if skipped else "")
    out = [_no_server_errors(trace, seen, label), _frames(seen)]
    if any(r.client.hangup_after_frames is not None or r.client.hangup_at_step is not None
           or r.client.read == "never" for r in trace.requests):
        out.append(await _hangups_settle(t))
    # The twins run last, so their own requests cannot hide a slot left running; they are
    # listed third, beside the trace's other answers.
    out.insert(2, await _twins(t, trace, seen))
    return out


def _body(t: Target, req: TraceRequest) -> dict[str, Any] | bytes:
    return req.raw_body if req.raw_body is not None else {**req.body, "model": t.model,
                                                          **t.extra}


def _hangup_at(req: TraceRequest, start: float, step_s: float) -> float:
    c = req.client
    return start + c.hangup_at_step * step_s if c.hangup_at_step is not None else math.inf


async def _one(t: Target, req: TraceRequest, start: float, step_s: float,
               seen: dict[str, Seen], _: trio.Event) -> None:
    await trio.sleep_until(start + _arrival(req, step_s))
    body = _body(t, req)
    c = req.client
    pause = (c.read.n * step_s if isinstance(c.read, EverySteps)
             else c.read.s if isinstance(c.read, EverySeconds) else 0.0)
    pace = _pace(c.read, start, step_s) if isinstance(c.read, FramesByStep) else None
    result = Seen(req.path, body, hung_up=True)  # what stays if the hang-up comes first
    with trio.move_on_at(_hangup_at(req, start, step_s)):
        result = await t.send(req.path, body, hangup_after_frames=c.hangup_after_frames,
                              pause_s=pause, not_before=pace)
    seen[req.id] = result


def _pace(read: FramesByStep, start: float, step_s: float) -> Callable[[int], float]:
    def not_before(k: int) -> float:
        # By the boundary after step s the client had taken f frames: frame k + 1 not
        # before the first such step with f > k; after the last pair, eagerly.
        return next((start + s * step_s for s, f in read.pairs if f > k), 0.0)

    return not_before


async def _silent(t: Target, req: TraceRequest, start: float, step_s: float,
                  seen: dict[str, Seen], others_done: trio.Event) -> None:
    """A client that never reads: its request sent on a socket that takes nothing, closed
    at its hang-up or once every other request has ended. It has nothing to check but
    that its slot is freed."""
    await trio.sleep_until(start + _arrival(req, step_s))
    body = _body(t, req)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with trio.move_on_at(_hangup_at(req, start, step_s)):
        await pacing.silent_reader(t, req.path, raw, others_done)
    seen[req.id] = Seen(req.path, body, hung_up=True)


def _arrival(req: TraceRequest, step_s: float) -> float:
    return req.at_s if req.at_s is not None else (req.at_step or 0) * step_s


def _no_server_errors(trace: Trace, seen: dict[str, Seen], label: str) -> Outcome:
    failures = []
    for req in trace.requests:
        s = seen.get(req.id)
        if s is None or s.hung_up:
            continue
        a = answer.read(s) if s.status == 200 else None
        why = (f"the connection dropped ({s.dropped})" if s.dropped
               else f"status {s.status}" if s.status is None or s.status >= 500
               else f"an error frame: {a.error}" if a is not None and s.stream and a.error
               else _cut_short(s))
        if why:
            failures.append({"id": req.id, "why": why, "request": s.evidence()})
    return verdict("trace: no server errors", failures, f"{label}, none a 5xx or dropped",
                   f"{len(failures)} of {len(seen)} requests failed on the server's side")


def _frames(seen: dict[str, Seen]) -> Outcome:
    """No frame of the trace's streams says nothing or holds a lone surrogate (a split
    character shows as U+FFFD, which the twins compare)."""
    failures = []
    n = 0
    for rid, s in seen.items():
        for f in s.frames:
            n += 1
            piece = answer.frame_text(f.obj)
            why = checks.empty_frame(f.obj) or checks.bad_piece(piece, "\ufffd")
            if why:
                failures.append({"id": rid, "why": why, "frame": f.data[:400]})
    return verdict("trace: frames", failures, f"{n} frames, none empty or split",
                   f"{len(failures)} of {n} frames empty or split")


def _cut_short(s: Seen) -> str | None:
    """Why a 200 stream is not a whole answer: it ended without [DONE] or a finish_reason."""
    if s.status == 200 and s.frames and not (s.done or answer.read(s).finish_reason()):
        return "the stream ended without [DONE] or a finish_reason"
    return None


def deterministic(body: dict[str, Any]) -> bool:
    """Greedy, or sampled from a seed: the same answer streamed or not on any server that
    honours seeds."""
    return body.get("temperature") == 0 or isinstance(body.get("seed"), int)


async def _twins(t: Target, trace: Trace, seen: dict[str, Seen]) -> Outcome:
    failures = []
    checked = 0
    for req in trace.requests:
        s = seen.get(req.id)
        if (s is None or s.hung_up or _cut_short(s) or s.status != 200
                or req.raw_body is not None or not deterministic(req.body)):
            continue
        twin = {**req.body, "model": t.model, **t.extra, "stream": not s.stream}
        if not twin["stream"]:
            twin.pop("stream_options", None)  # refused without a stream (OpenAI, vLLM)
        other = await t.send(req.path, twin)
        checked += 1
        a, b = answer.read(s), answer.read(other)
        texts = {i: c.text for i, c in a.choices.items()}
        twin_texts = {i: c.text for i, c in b.choices.items()}
        if other.status != 200 or texts != twin_texts:
            failures.append({"id": req.id, "streamed": s.stream, "texts": texts,
                             "twin_status": other.status, "twin_texts": twin_texts})
    return verdict("trace: stream = unary", failures,
                   f"{checked} deterministic requests alike streamed and unary",
                   f"{len(failures)} of {checked} deterministic requests differ")


async def _hangups_settle(t: Target) -> Outcome:
    name = "trace: hang-ups free their slots"
    if await load.running(t) is None:
        return Outcome(name, "unsupported", "no running-requests gauge (/metrics, /slots)")
    took, values = await load.settle(t)
    if took is None:
        return Outcome(name, "fail", f"requests still running {t.settle_s} s after the "
                       "trace's last answer", ({"running": values[-20:]},))
    return Outcome(name, "pass", f"nothing running {took:.2f} s after the last answer")
