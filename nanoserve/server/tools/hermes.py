"""Hermes tool calls (Qwen2.5, Qwen3, Hermes 2/3; ChatML templates):

    I'll look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    ...

Text outside the blocks is content, less the whitespace that touches a block. A block whose
JSON is not a call is content, verbatim, from its `<tool_call>` on; the last block may lack
its `</tool_call>` (the output ended), and is a call if its JSON is whole.
"""

from __future__ import annotations

from nanoserve.server.tools.base import (
    Event,
    IdSource,
    SteppedParser,
    call_from_object,
    content,
    load_json,
)

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesToolParser(SteppedParser):
    def __init__(self, new_id: IdSource | None = None) -> None:
        super().__init__(new_id)
        self._in_call = False

    def finish(self) -> list[Event]:
        out: list[Event] = []
        while self._in_call:
            body, self._buf = self._buf, ""
            self._close(body, closed=False, out=out)
            while self._step(out):
                pass
        out += content(self._buf)
        self._buf = ""
        return out

    def _step(self, out: list[Event]) -> bool:
        """Decide what the buffer allows; True if a marker moved the state on."""
        if self._in_call:
            end = self._buf.find(CLOSE)
            if end < 0:
                return False
            body, self._buf = self._buf[:end], self._buf[end + len(CLOSE) :]
            self._close(body, closed=True, out=out)
            return True
        if not self._text_until(OPEN, out):
            return False
        self._in_call = True
        return True

    def _close(self, body: str, closed: bool, out: list[Event]) -> None:
        """A block's body is complete: a call if it reads as one, else content again."""
        self._in_call = False
        call = call_from_object(load_json(body))
        if call is not None:
            out += self._call(*call)
            self._after_call = True
        else:
            # Rejected: the text from the gap on is plain text again, re-read as such (a
            # later `<tool_call>` inside it still opens a block).
            out += content(self._gap + OPEN)
            self._buf = body + (CLOSE if closed else "") + self._buf
        self._gap = ""
