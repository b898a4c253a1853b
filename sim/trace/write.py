"""Writing a trace: the inverse of `load_trace` (loader.py).

The writer emits one JSON object per line with known keys in the format's order, then any
unknown keys in the order they were read ("implementations may add fields"), and leaves
`body` in the client's own order; absent optionals are omitted. So loading and rewriting a
trace the writer produced gives the same bytes, and a diff of two traces is a diff of facts.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterator
from typing import Any

from sim.files import atomic_open
from sim.trace.format import (
    TRACE_VERSION,
    ClientSpec,
    EverySeconds,
    EverySteps,
    Expectation,
    FramesByStep,
    Trace,
    TraceHeader,
    TraceRequest,
)


def iter_trace_lines(trace: Trace) -> Iterator[str]:
    """The trace's lines, without newlines (a generator: a converted trace can be large)."""
    yield dumps_line(header_object(trace.header))
    for r in trace.requests:
        yield dumps_line(request_object(r))
    for e in trace.expectations:
        yield dumps_line(expectation_object(e))


def header_object(h: TraceHeader) -> dict[str, Any]:
    head: dict[str, Any] = {"nanoserve_trace": TRACE_VERSION, "clock": h.clock,
                            "model": h.model, "engine": h.engine}
    _put(head, "note", h.note)
    _put(head, "cost_model", h.cost_model)
    _put(head, "faults", list(h.faults) or None)
    _put(head, "body_timeout", h.body_timeout)
    _put(head, "server", h.server or None)
    return {**head, **h.extra}


def request_object(r: TraceRequest) -> dict[str, Any]:
    line: dict[str, Any] = {"id": r.id}
    _put(line, "at_step", r.at_step)
    _put(line, "at_s", r.at_s)
    line["path"] = r.path
    if r.raw_body is not None:
        line["body_base64"] = base64.b64encode(r.raw_body).decode("ascii")
    else:
        line["body"] = r.body
    line["client"] = client_object(r.client)
    return {**line, **r.extra}


def expectation_object(e: Expectation) -> dict[str, Any]:
    return {"expect": e.id, **e.fields}


def dumps_trace(trace: Trace) -> str:
    return "".join(line + "\n" for line in iter_trace_lines(trace))


def write_trace(trace: Trace, path: str | os.PathLike[str]) -> None:
    with atomic_open(path) as f:  # never half a trace under its name
        for line in iter_trace_lines(trace):
            f.write(line + "\n")


def client_object(c: ClientSpec) -> dict[str, Any]:
    read: Any = c.read
    if isinstance(c.read, EverySteps):
        read = {"every_steps": c.read.n}
    elif isinstance(c.read, EverySeconds):
        read = {"every_s": c.read.s}
    elif isinstance(c.read, FramesByStep):
        read = {"frames_by_step": [[s, f] for s, f in c.read.pairs]}
    out: dict[str, Any] = {"read": read}
    _put(out, "hangup_after_frames", c.hangup_after_frames)
    _put(out, "hangup_at_step", c.hangup_at_step)
    _put(out, "send_body_bytes", c.send_body_bytes)
    _put(out, "then", c.then)
    return {**out, **c.extra}


def _put(d: dict[str, Any], key: str, value: object) -> None:
    if value is not None:
        d[key] = value


def dumps_line(obj: dict[str, Any]) -> str:
    """One line of strict JSON. allow_nan=False: NaN is not JSON, and the loader would refuse
    what we wrote. A string holding a lone surrogate (which UTF-8 cannot encode) is written
    escaped, as `\\udXXXX`, which reads back as the same string."""
    line = json.dumps(obj, ensure_ascii=False, allow_nan=False)
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(obj, ensure_ascii=True, allow_nan=False)
    return line
