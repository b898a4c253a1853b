"""Trace format v1: typed records and a strict loader (the
writer is write.py).

A trace is the contract between the recorder, `sim replay`, `sim load` and the tests, so the
loader is strict: a malformed line fails with `TraceError` naming its line number and field,
before anything is replayed. It checks what makes a trace replayable (the header, the clock's
time field, unique ids, arrival order, the client's reading pattern) and never a request
`body`: that is exactly what an HTTP client sent, and a trace may send a bad one on purpose.

What this implementation adds to the original v1 (the format allows added fields): a third
reading pattern, `client.read: {"frames_by_step": [[step, frames], ...]}`, which the
recorder writes for slow readers and hang-ups (`FramesByStep`); and, on expectation lines,
`error`, `frames`, `aborted`, `hangup_step` and, for n > 1, `choices` (sim/trace/expect.py).

A request line may give `body_base64` (the exact bytes, base64) in place of `body`, for a body
strict JSON cannot hold (a NaN, a lone surrogate, no object at all): replay sends those bytes
as they are. A file whose header carries `"incomplete"` is a recording that has not finished
(sim/trace/journal.py); the loader puts it in trace order first.

Faults (issue 9), all optional, so every v1 trace without them reads and replays as before:

- header `"faults": [{"kind": ..., ...}, ...]`: faults the replay injects through wrappers
  around the model, tokenizer and scheduler (sim/replay/faults.py names the kinds):
  `{"kind": "step_raises", "at_step": K}`, `{"kind": "schedule_raises", "at_step": K}`,
  `{"kind": "encode_raises", "text": T}`, `{"kind": "detokenize_raises", "token_id": I}`;
- header `"body_timeout": X`: the server's request-body timeout in seconds (a 408 after it);
  absent, a replay's server waits for a body for ever;
- `client.read: "never"`: the client takes no frame at all; it closes the connection at
  `hangup_at_step` if it gives one, else once the server is idle for good (nothing it has
  not read will change then);
- `client.send_body_bytes: N` with `client.then: "stall"`: the client announces its whole
  body (Content-Length) but sends only its first N bytes, then nothing, and waits; the
  server must answer 408 after `body_timeout` without queueing anything. Under the step clock
  seconds pass only while nothing else can happen, so the 408 comes once the engine is idle;
- on the `end` expectation, `loop_failed: true` when the engine loop died (a
  `schedule_raises` fault); absent, none is expected.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from sim.trace.check import (
    FieldError,
    check_base64,
    check_body_timeout,
    check_client,
    check_cost_model,
    check_engine,
    check_expectation,
    check_faults,
    check_str,
    check_time,
    lenient_object,
)
from sim.trace.journal import JournalError, is_incomplete, recover

TRACE_VERSION = 1
PATHS = ("/v1/completions", "/v1/chat/completions")
ClockKind = Literal["step", "virtual"]


class TraceError(ValueError):
    """A malformed trace: `line 3: field "at_step": must be an integer >= 0, got -1`."""

    def __init__(self, line: int, message: str, field: str | None = None) -> None:
        where = f"line {line}: " + (f'field "{field}": ' if field else "")
        super().__init__(where + message)
        self.line = line
        self.field = field
        self.message = message


@dataclass(frozen=True, slots=True)
class EverySteps:
    """The client reads one SSE frame every `n` steps."""

    n: int


@dataclass(frozen=True, slots=True)
class EverySeconds:
    """The client reads one SSE frame every `s` seconds (virtual clock only)."""

    s: float


@dataclass(frozen=True, slots=True)
class FramesByStep:
    """A recorded reading pattern (`serve --record`, a slow reader or a hang-up): by the
    boundary after step `s` the client had taken `f` SSE frames, for each `(s, f)`; steps
    increase. Before the first pair it has taken none; after the last it reads eagerly."""

    pairs: tuple[tuple[int, int], ...]

    def allowed(self, step: int) -> int | None:
        """Frames the client may have taken by the boundary after `step`; None: no limit."""
        if step > self.pairs[-1][0]:
            return None
        taken = 0
        for s, f in self.pairs:
            if s > step:
                break
            taken = f
        return taken


Read = Literal["eager", "never"] | EverySteps | EverySeconds | FramesByStep


@dataclass(frozen=True, slots=True)
class ClientSpec:
    read: Read = "eager"
    hangup_after_frames: int | None = None  # close after this many SSE frames
    hangup_at_step: int | None = None  # close at this step, whatever was read
    extra: dict[str, Any] = field(default_factory=dict)
    send_body_bytes: int | None = None  # send only this much of the body, then `then`
    then: Literal["stall"] | None = None


@dataclass(frozen=True, slots=True)
class TraceHeader:
    clock: ClockKind
    model: str
    # Every engine setting that changes the schedule. Required: block_size, num_blocks,
    # max_num_seqs, max_num_batched_tokens, seed. Optional: max_model_len, prefix_caching,
    # max_queue, stub_eos_prob, model_sha256. Unknown keys are kept for replay to refuse.
    engine: dict[str, Any]
    note: str | None = None
    cost_model: str | dict[str, Any] | None = None  # a path or an inline object; virtual only
    extra: dict[str, Any] = field(default_factory=dict)
    faults: tuple[dict[str, Any], ...] = ()  # injected by the replay (sim/replay/faults.py)
    body_timeout: float | None = None  # the server's body timeout, seconds; None: none


@dataclass(frozen=True, slots=True)
class TraceRequest:
    id: str
    path: str
    body: dict[str, Any]  # exactly what the client sent, in its key order
    client: ClientSpec = field(default_factory=ClientSpec)
    at_step: int | None = None  # step clock: admitted after this many steps
    at_s: float | None = None  # virtual clock: arrival in seconds
    extra: dict[str, Any] = field(default_factory=dict)
    # The exact bytes the client sent, where strict JSON cannot hold its body (a NaN, a lone
    # surrogate, not an object at all): `body_base64` in the file, sent as they are; `body`
    # is then what a lenient parse makes of them ({} if not an object), for reading only.
    raw_body: bytes | None = None


@dataclass(frozen=True, slots=True)
class Expectation:
    """`{"expect": id, ...}`. For a request id the known fields are status, finish_reason,
    completion_tokens, token_ids, text, first_token_step, last_step; for `"end"` they are
    steps, free_blocks, peak_used_blocks, preemptions. Unknown fields are kept as they are."""

    id: str  # a request id, or "end"
    fields: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Trace:
    header: TraceHeader
    requests: tuple[TraceRequest, ...]
    expectations: tuple[Expectation, ...] = ()


# ---------------------------------------------------------------------------------- loading

_HEADER_KEYS = ("nanoserve_trace", "clock", "model", "engine", "note", "cost_model", "faults",
                "body_timeout")
_REQUEST_KEYS = ("id", "at_step", "at_s", "path", "body", "body_base64", "client")
_CLIENT_KEYS = ("read", "hangup_after_frames", "hangup_at_step", "send_body_bytes", "then")


def load_trace(path_or_lines: str | os.PathLike[str] | Iterable[str]) -> Trace:
    """A trace from a file path, or from an iterable of its lines (numbered from 1)."""
    if isinstance(path_or_lines, str | os.PathLike):
        try:
            with open(path_or_lines, encoding="utf-8") as f:
                return _parse(f)
        except UnicodeDecodeError:  # a binary or Latin-1 file: say where, in one line
            bad = _undecodable(path_or_lines)
            if bad is None:
                raise
            raise TraceError(bad[0], f"not UTF-8 text (byte 0x{bad[1]:02x} at column "
                             f"{bad[2]}); a trace is JSON Lines in UTF-8") from None
    return _parse(path_or_lines)


def _undecodable(path: str | os.PathLike[str]) -> tuple[int, int, int] | None:
    """The first line that is not UTF-8: (its number, the bad byte, its column)."""
    with open(path, "rb") as f:
        # Split at b"\n" as the text reader does: that byte is never inside a UTF-8 character.
        for number, raw in enumerate(f, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                return number, raw[exc.start], exc.start + 1
    return None


def loads_trace(text: str) -> Trace:
    return _parse(text.splitlines())


def _parse(lines: Iterable[str]) -> Trace:
    lines = iter(lines)
    first = next(lines, None)
    if first is None:
        raise TraceError(1, "the trace is empty; line 1 must be the header", "nanoserve_trace")
    if is_incomplete(first):  # a recording that has not been closed: put it in trace order
        try:
            return _parse_lines(list(recover(first, lines)))
        except JournalError as exc:
            raise TraceError(exc.line, exc.message) from None
    return _parse_lines(itertools.chain([first], lines))


def _parse_lines(lines: Iterable[str]) -> Trace:
    header: TraceHeader | None = None
    requests: list[TraceRequest] = []
    expectations: list[Expectation] = []
    first_line: dict[str, int] = {}  # request id -> its line, for duplicate messages
    expected: dict[str, int] = {}
    last_at: float = 0.0
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue  # a blank line (a trailing newline, a hand edit) carries nothing
        obj = _json_object(raw, number)
        try:
            if header is None:
                header = _header(obj)
            elif "nanoserve_trace" in obj:
                raise FieldError("nanoserve_trace", "a second header; only line 1 is one")
            elif "expect" in obj:
                expectations.append(_expectation(obj, first_line, expected, number))
            else:
                if expectations:
                    raise FieldError(None, "a request after expectation lines; requests "
                                     "come first")
                req = _request(obj, header, first_line, last_at, number)
                last_at = req.at_step if req.at_step is not None else req.at_s or 0.0
                requests.append(req)
        except FieldError as exc:
            raise TraceError(number, exc.message, exc.field) from None
    if header is None:
        raise TraceError(1, "the trace is empty; line 1 must be the header", "nanoserve_trace")
    return Trace(header, tuple(requests), tuple(expectations))


def _json_object(raw: str, number: int) -> dict[str, Any]:
    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    try:
        obj = json.loads(raw, parse_constant=no_constants)
    except (ValueError, RecursionError) as exc:
        raise TraceError(number, f"not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise TraceError(number, f"must be a JSON object, got {type(obj).__name__}")
    return obj


def _header(obj: dict[str, Any]) -> TraceHeader:
    if "nanoserve_trace" not in obj:
        raise FieldError("nanoserve_trace", "line 1 must be the header, "
                         '{"nanoserve_trace": 1, "clock": ..., "model": ..., "engine": ...}')
    version = obj["nanoserve_trace"]
    if version != TRACE_VERSION or isinstance(version, bool):
        raise FieldError("nanoserve_trace", f"this reader knows version {TRACE_VERSION}, "
                         f"got {version!r}")
    clock = obj.get("clock")
    if clock not in ("step", "virtual"):
        raise FieldError("clock", f'must be "step" or "virtual", got {clock!r}')
    model = check_str(obj, "model")
    engine = check_engine(obj.get("engine"))
    note = obj.get("note")
    if note is not None and not isinstance(note, str):
        raise FieldError("note", f"must be a string, got {note!r:.80}")
    cost_model = check_cost_model(obj.get("cost_model"), clock)
    faults = check_faults(obj.get("faults"))
    body_timeout = check_body_timeout(obj.get("body_timeout"))
    return TraceHeader(clock, model, engine, note, cost_model, _extra(obj, _HEADER_KEYS),
                       faults, body_timeout)


def _request(obj: dict[str, Any], header: TraceHeader, first_line: dict[str, int],
             last_at: float, number: int) -> TraceRequest:
    rid = check_str(obj, "id")
    if rid == "end":
        raise FieldError("id", '"end" is reserved for the end-of-trace expectation')
    if rid in first_line:
        raise FieldError("id", f"duplicate request id {rid!r} (first on line {first_line[rid]})")
    at_step, at_s = check_time(obj, header.clock, last_at)
    path = obj.get("path")
    if path not in PATHS:
        raise FieldError("path", f"must be one of {', '.join(PATHS)}, got {path!r:.80}")
    raw_body = None
    body: Any
    if "body_base64" in obj:
        if "body" in obj:
            raise FieldError("body_base64", "a request gives body or body_base64, not both")
        raw_body = check_base64(obj["body_base64"], "body_base64")
        body = lenient_object(raw_body)
    else:
        body = obj.get("body")
        if not isinstance(body, dict):
            raise FieldError("body", f"must be a JSON object, got {body!r:.80}")
    read, after, at, partial = check_client(obj.get("client"), header.clock)
    client = ClientSpec(parse_read(read), after, at, _extra(obj["client"], _CLIENT_KEYS),
                        partial, "stall" if partial is not None else None)
    first_line[rid] = number
    return TraceRequest(rid, path, body, client, at_step, at_s, _extra(obj, _REQUEST_KEYS),
                        raw_body)


def parse_read(raw: str | dict[str, Any]) -> Read:
    """A `client.read` value, once `check_client` has accepted it."""
    if raw in ("eager", "never"):
        return "never" if raw == "never" else "eager"
    assert isinstance(raw, dict)  # check_client accepted it
    if "frames_by_step" in raw:
        return FramesByStep(tuple((s, f) for s, f in raw["frames_by_step"]))
    if "every_steps" in raw:
        return EverySteps(raw["every_steps"])
    return EverySeconds(raw["every_s"])


def _expectation(obj: dict[str, Any], first_line: dict[str, int], expected: dict[str, int],
                 number: int) -> Expectation:
    eid = obj["expect"]
    if not isinstance(eid, str):
        raise FieldError("expect", f'must be a request id or "end", got {eid!r:.80}')
    if eid != "end" and eid not in first_line:
        raise FieldError("expect", f"no request has id {eid!r}")
    if eid in expected:
        raise FieldError("expect", f"a second expectation for {eid!r} (first on line "
                         f"{expected[eid]})")
    fields = {k: v for k, v in obj.items() if k != "expect"}
    check_expectation(eid, fields)
    expected[eid] = number
    return Expectation(eid, fields)


def _extra(obj: dict[str, Any], known: tuple[str, ...]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in known}
