"""Loading a trace: its lines into the records of format.py, strictly.

A trace is the contract between the recorder, `sim replay`, `sim load` and the tests, so the
loader is strict: a malformed line fails with `TraceError` naming its line number and field,
before anything is replayed. It checks what makes a trace replayable (the header, the clock's
time field, unique ids, arrival order, the client's reading pattern) and never a request
`body`: that is exactly what an HTTP client sent, and a trace may send a bad one on purpose.
The rules for one field are check.py's (the CLI applies them too); this module adds the line
numbers and the rules between lines: one header, unique ids, requests before expectations,
each expectation for a known request.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterable
from typing import Any

from sim.trace.check import (
    FieldError,
    check_base64,
    check_body_timeout,
    check_client,
    check_cost_model,
    check_engine,
    check_expectation,
    check_faults,
    check_server,
    check_str,
    check_time,
    lenient_object,
)
from sim.trace.format import (
    PATHS,
    TRACE_VERSION,
    ClientSpec,
    EverySeconds,
    EverySteps,
    Expectation,
    FramesByStep,
    Read,
    Trace,
    TraceHeader,
    TraceRequest,
)
from sim.trace.journal import JournalError, is_incomplete, recover


class TraceError(ValueError):
    """A malformed trace: `line 3: field "at_step": must be an integer >= 0, got -1`."""

    def __init__(self, line: int, message: str, field: str | None = None) -> None:
        where = f"line {line}: " + (f'field "{field}": ' if field else "")
        super().__init__(where + message)
        self.line = line
        self.field = field
        self.message = message


_HEADER_KEYS = ("nanoserve_trace", "clock", "model", "engine", "note", "cost_model", "faults",
                "body_timeout", "server")
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
                       faults, body_timeout, check_server(obj.get("server")))


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
