"""Server-sent events for `sim bench`: an incremental parser and what an OpenAI chunk says.

The bench reads streams from servers it did not write, so the parser takes the SSE rules
as the HTML spec states them rather than nanoserve's own framing: events end at a blank
line; a line ends at CRLF, LF or CR; several `data:` lines join with "\\n"; one space
after the colon is dropped; comments (`: ping`) and other fields (`event:`, `id:`) carry no
data. Bytes arrive in whatever pieces TCP delivers them, so a line may be split anywhere,
even inside a multi-byte UTF-8 character: the parser buffers bytes and decodes whole lines.

A stream ends at `data: [DONE]` (nanoserve, vLLM) or at EOF (Hugging Face's `transformers
serve` sends no terminator on /v1/completions). A failure after the first byte is an
`{"error": {...}}` frame (docs/ARCHITECTURE.md), which `read_chunk` turns into `Chunk.error`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

DONE = "[DONE]"


class SseParser:
    """Feed bytes, get the `data` of each complete event. `close()` flushes an event that
    the stream ended without a blank line after (EOF dispatches nothing per the spec, but a
    truncated last frame is worth reporting, not dropping)."""

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buf += chunk
        events: list[str] = []
        while True:
            cut = _line_end(self._buf)
            if cut is None:
                return events
            end, skip = cut
            line = self._buf[:end].decode("utf-8", errors="replace")
            self._buf = self._buf[end + skip:]
            event = self._line(line)
            if event is not None:
                events.append(event)

    def close(self) -> list[str]:
        events = self.feed(b"\n") if self._buf else []
        if self._data:
            events.append("\n".join(self._data))
            self._data = []
        return events

    def _line(self, line: str) -> str | None:
        if not line:  # a blank line dispatches the event, if it had data
            data, self._data = self._data, []
            return "\n".join(data) if data else None
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        return None  # a comment (empty name) or a field the bench has no use for


def _line_end(buf: bytes) -> tuple[int, int] | None:
    """(index of the first line terminator, its length), or None if no line is complete.
    A CR at the very end may be the first half of CRLF, so it waits for the next byte."""
    for i, b in enumerate(buf):
        if b == 0x0A:
            return i, 1
        if b == 0x0D:
            if i + 1 == len(buf):
                return None
            return i, 2 if buf[i + 1] == 0x0A else 1
    return None


@dataclass(frozen=True, slots=True)
class Chunk:
    """One parsed `data:` payload of a completion or chat stream."""

    text: str = ""  # the content this frame adds, over all choices
    has_content: bool = False  # it carried a non-empty text or content delta
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None  # an error frame's message
    done: bool = False  # the `[DONE]` terminator


def read_chunk(data: str) -> Chunk:
    """Interpret one event's data. A frame that is not JSON is an error (it says so), not a
    crash: a benchmark of a broken server should report, not stop."""
    if data.strip() == DONE:
        return Chunk(done=True)
    try:
        obj = json.loads(data)
    except ValueError:
        return Chunk(error=f"not JSON: {data[:200]!r}")
    if not isinstance(obj, dict):
        return Chunk(error=f"not a JSON object: {data[:200]!r}")
    if "error" in obj:
        err = obj["error"]
        message = err.get("message") if isinstance(err, dict) else None
        return Chunk(error=str(message or err))
    texts: list[str] = []
    finish = None
    for choice in obj.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        # Completions carry `text`; chat carries `delta.content` (and a first delta with
        # only the role, which is not a token).
        piece = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        if isinstance(piece, str) and piece:
            texts.append(piece)
        finish = choice.get("finish_reason") or finish
    usage = obj.get("usage")
    text = "".join(texts)
    return Chunk(text=text, has_content=bool(text), finish_reason=finish,
                 usage=usage if isinstance(usage, dict) else None)
