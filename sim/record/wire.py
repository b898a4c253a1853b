"""What a client read, from the bytes the server sent: the client's half of an outcome.

`sim.trace.expect` takes text, frames and the error code from the wire (what the client saw) and
token ids and steps from the engine. The recorder has the bytes the transport took from the
app, which are what a client read (or, for a slow reader, was about to), so it parses them
here into the same facts: one text and finish reason per choice `index`, the SSE data frames
(`[DONE]` not counted), and the `code` of an error body or error frame.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from sim.trace.expect import CallsRead


@dataclass(slots=True)
class Wire:
    stream: bool  # an SSE body (a 200 to a streaming request)
    frames: int = 0
    error: str | None = None
    texts: dict[int, str] = field(default_factory=dict)
    reasons: dict[int, str] = field(default_factory=dict)
    calls: CallsRead = field(default_factory=CallsRead)  # tool calls, per choice

    def text(self, index: int) -> str:
        return self.texts.get(index, "")

    def finish_reason(self, index: int) -> str | None:
        return self.reasons.get(index)


def parse_wire(status: int | None, raw: bytes, stream: bool) -> Wire:
    """`raw`: the whole body as sent; `stream`: the request asked for a stream."""
    wire = Wire(stream=stream and status == 200)
    if status is None or not raw:
        return wire
    if not wire.stream:
        obj = _json(raw)
        if status != 200:
            wire.error = _error_code(obj)
        elif isinstance(obj, dict):
            for c in obj.get("choices") or []:
                _add(wire, c, c.get("message") or {})
        return wire
    for block in raw.split(b"\n\n"):
        if not block.startswith(b"data: ") or block == b"data: [DONE]":
            continue
        wire.frames += 1
        obj = _json(block[len(b"data: "):])
        if not isinstance(obj, dict):
            continue
        if "error" in obj:
            wire.error = _error_code(obj)
        for c in obj.get("choices") or []:
            _add(wire, c, c.get("delta") or {})
    return wire


def _add(wire: Wire, choice: dict[str, Any], message: dict[str, Any]) -> None:
    index = choice.get("index", 0)
    piece = choice.get("text")
    if piece is None:
        piece = message.get("content")
    wire.texts[index] = wire.texts.get(index, "") + (piece or "")
    wire.calls.add(choice, "delta" if "delta" in choice else "message")
    if choice.get("finish_reason") is not None:
        wire.reasons[index] = choice["finish_reason"]


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _error_code(obj: Any) -> str | None:
    err = obj.get("error") if isinstance(obj, dict) else None
    if not isinstance(err, dict):
        return None
    code = err.get("code")
    return code if isinstance(code, str) else None
