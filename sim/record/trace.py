"""One recorded HTTP exchange, and how it becomes a trace request line and its outcome.

`sim.record.recorder` explains the choices (which boundary is `at_step`, why a hang-up is
recorded at
the abort's boundary, when a client gets a `frames_by_step` reading pattern); this module
holds the per-exchange state the hooks fill in and the functions that apply those choices.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from sim.record.wire import Wire
from sim.trace.expect import ChoiceOutcome, RequestOutcome
from sim.trace.format import ClientSpec, FramesByStep, Read, TraceRequest

log = logging.getLogger("sim.record")


class Tracker(Protocol):
    """What an exchange asks its recorder: the step count now, a fresh engine record, and
    to write what it can once the exchange is over."""

    def steps(self) -> int: ...

    def track(self, request_id: str, ex: Exchange) -> EngineRequest: ...

    def refused(self, ex: Exchange) -> None: ...

    def finished(self, ex: Exchange) -> None: ...


@dataclass(slots=True, eq=False)
class Completion:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # of its final update, once there is one


@dataclass(slots=True, eq=False)
class EngineRequest:
    """One engine request (one prompt) of an exchange, as the bridge reported it."""

    arrival: int | None = None  # the bridge's arrival order, once a boundary took it
    at_step: int | None = None
    abort_step: int | None = None
    first_step: int | None = None
    last_step: int | None = None
    completions: dict[int, Completion] = field(default_factory=dict)
    ended: int = 0  # completions with their final update
    # The step of each update that makes an SSE frame (text, or a finish other than an
    # abort): the frames an eager reader has had by a boundary.
    frame_steps: list[int] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class Exchange:
    """One generation request's HTTP exchange (server.recording.ExchangeRecorder)."""

    recorder: Tracker
    seq: int
    path: str
    received_step: int
    body_bytes: bytearray = field(default_factory=bytearray)
    engine: list[EngineRequest] = field(default_factory=list)
    status: int | None = None
    chunks: list[tuple[int, bytes]] = field(default_factory=list)  # (step taken, bytes)
    complete: bool = False  # the transport took the last body message
    got_all: bool = False  # ... or the whole JSON body, or the stream's [DONE]
    pushed_back: bool = False  # a send was still blocked when a step ended
    disconnect_step: int | None = None  # the client left before the response ended
    over: bool = False  # done(): the exchange has ended, for any reason
    journal_id: str | None = None  # its id in the file, once a line about it is written
    hangup_written: bool = False
    _send_step: int = 0
    _parsed: tuple[dict[str, Any], bytes | None] | None = None

    def body(self, chunk: bytes) -> None:
        self.body_bytes += chunk

    def engine_ids(self, ids: Sequence[str]) -> None:
        self.engine = [self.recorder.track(rid, self) for rid in ids]

    def sending(self) -> None:
        self._send_step = self.recorder.steps()

    def sent(self, status: int | None, chunk: bytes, more: bool) -> None:
        step = self.recorder.steps()
        self.pushed_back |= step > self._send_step
        if status is not None:
            self.status = status
            if not self.engine:  # answered without the engine: a refusal, recorded now
                self.recorder.refused(self)
            return
        if chunk:
            self.chunks.append((step, chunk))
            self.got_all |= b"data: [DONE]" in chunk or not chunk.startswith(b"data: ")
        self.complete |= not more

    def hangup(self) -> None:
        # A client that had the whole response and left before the final (empty) message
        # read everything: not a hang-up that a replay could, or needs to, repeat.
        if not (self.complete or self.got_all) and self.disconnect_step is None:
            self.disconnect_step = self.recorder.steps()

    def done(self) -> None:
        self.over = True
        self.recorder.finished(self)

    def parsed(self) -> tuple[dict[str, Any], bytes | None]:
        """json_body of the request body, parsed once: it is whole by the time anything
        asks (the route queued its requests, or the status went out)."""
        if self._parsed is None:
            self._parsed = json_body(bytes(self.body_bytes))
        return self._parsed

    def completions_per_prompt(self) -> int:
        """`n` of an accepted body (each engine request has that many completions)."""
        n = self.parsed()[0].get("n")
        return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1

    def ended(self) -> bool:
        """Over, and every engine request has had the final update of every completion
        (a hang-up's abort comes at the boundary after the exchange ended)."""
        n = self.completions_per_prompt() if self.engine else 0
        return self.over and all(r.ended >= n for r in self.engine)


def json_body(raw: bytes) -> tuple[dict[str, Any], bytes | None]:
    """(body, None) for a body strict JSON can hold as an object; else (what a lenient parse
    makes of it, the bytes as sent): a NaN, a lone surrogate, or no object at all is
    recorded as the bytes, which replay sends as they are."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return {}, raw
    if not isinstance(body, dict):
        return {}, raw
    try:
        json.dumps(body, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (ValueError, UnicodeEncodeError, RecursionError):
        return body, raw
    return body, None


def order(ex: Exchange) -> tuple[int, int, int] | None:
    """Where the exchange goes in the trace, or None if a replay cannot repeat it: taken by
    a boundary, in the bridge's order; refused before the bridge, where it was received."""
    if ex.engine:
        first = ex.engine[0]
        if first.at_step is None or first.arrival is None:
            return None  # queued, then the server stopped before a boundary took it
        return first.at_step, 0, first.arrival
    if ex.status is None or ex.status == 503:  # loading, draining, or a client gone early
        return None
    if ex.status != 400 and ex.parsed()[1] is not None:
        # A 408 or 413 cut the body short: its bytes are not what the client meant to send.
        log.warning("not recorded: %s answered %d to a body that is not a JSON object",
                    ex.path, ex.status)
        return None
    return ex.received_step, 1, ex.seq


def request_line(
    rid: str, ex: Exchange, wire: Wire
) -> tuple[TraceRequest, RequestOutcome]:
    """The trace line of one exchange and its outcome (`sim.record.recorder` says why each
    field)."""
    at_step = ex.engine[0].at_step if ex.engine else ex.received_step
    assert at_step is not None
    aborts = [r.abort_step for r in ex.engine if r.abort_step is not None]
    taken = [step for step, chunk in ex.chunks for _ in range(_frames_in(chunk))]
    hangup: int | None = None
    if ex.disconnect_step is not None and aborts:
        hangup = min(aborts)  # the boundary that applied the abort
    elif ex.disconnect_step is not None and wire.stream and not _eager_until(ex, taken, None):
        # Every prompt had ended (nothing to abort) but the client left before it had read
        # every frame: it hung up at the boundary its disconnect came before. (A unary
        # client leaving in the instant between its last step and its body is not a
        # hang-up a replay can place: at that boundary its body is already there.)
        hangup = max(ex.disconnect_step, at_step) or None  # 0: before any step
    elif aborts:  # the server ended it (shutdown): a replay can only hang up there
        hangup = min(aborts)
    read: Read = "eager"
    stayed = ex.disconnect_step is None
    if wire.stream and (ex.pushed_back or not (stayed or _eager_until(ex, taken, hangup))):
        read = FramesByStep(frames_by_step(taken, hangup))
    client = ClientSpec(read, hangup_at_step=hangup)
    n = max((len(r.completions) for r in ex.engine), default=0)
    choices = []
    for k, req in enumerate(ex.engine):
        for i, c in sorted(req.completions.items()):
            index = k * n + i  # the response's choice index: prompt-major
            reason = c.finish_reason or wire.finish_reason(index) or "abort"
            choices.append(ChoiceOutcome(reason, tuple(c.token_ids), wire.text(index),
                                         wire.calls.of(index)))
    firsts = [r.first_step for r in ex.engine if r.first_step is not None]
    lasts = [r.last_step for r in ex.engine if r.last_step is not None]
    aborted = any(c.finish_reason == "abort" for r in ex.engine for c in r.completions.values())
    outcome = RequestOutcome(rid, ex.status, wire.error, tuple(choices),
                             min(firsts, default=None), max(lasts, default=None),
                             wire.frames, aborted, hangup)
    body, raw = ex.parsed()
    return TraceRequest(rid, ex.path, body, client, at_step=at_step, raw_body=raw), outcome


def _eager_until(ex: Exchange, taken: list[int], hangup: int | None) -> bool:
    """Did the client read what an eager reader would have by its hang-up (by the end, with
    None), every frame made by steps up to that boundary? Under the live clock one that hung
    up often has one less: the step running when it left made a frame that was never sent."""
    made = sum(1 for r in ex.engine for step in r.frame_steps
               if hangup is None or step <= hangup)
    return len(taken) >= made  # (a usage chunk is a frame no update made)


def frames_by_step(steps: Sequence[int], hangup: int | None) -> tuple[tuple[int, int], ...]:
    """`((step, frames taken by then), ...)` from the step at which each frame was taken:
    one pair per step at which the count grew, and with a hang-up a last pair at its step
    (so a replay reads no further before it hangs up)."""
    pairs: list[tuple[int, int]] = []
    for n, step in enumerate(steps, start=1):
        if pairs and pairs[-1][0] == step:
            pairs[-1] = (step, n)
        else:
            pairs.append((step, n))
    if hangup is not None and (not pairs or pairs[-1][0] < hangup):
        pairs.append((hangup, len(steps)))
    return tuple(pairs)


def _frames_in(chunk: bytes) -> int:
    """SSE data frames in one body chunk, `[DONE]` not counted (as `sim.trace.expect` counts)."""
    return sum(1 for block in chunk.split(b"\n\n")
               if block.startswith(b"data: ") and block != b"data: [DONE]")

