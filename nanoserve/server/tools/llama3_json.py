"""Llama 3.1/3.2 JSON tool calls: the whole output is the call(s), nothing before them.

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

The `<|python_tag|>` is optional, `"arguments"` is accepted for `"parameters"`, and calls are
separated by `;` (a bare newline is accepted too). An output that does not open with a
`{` (after the tag) is content throughout. A call is emitted as soon as its object closes;
text after the last call that is not another call is content, verbatim, as is an object
that is not a call (and everything after it). A trailing `;` or whitespace is dropped.
"""

from __future__ import annotations

from enum import Enum

from nanoserve.server.tools.base import (
    Event,
    IdSource,
    SteppedParser,
    call_from_object,
    content,
    find_opening,
    load_json,
)

PYTHON_TAG = "<|python_tag|>"


class _State(Enum):
    BEGIN = "begin"  # before the first object: whitespace, maybe the tag
    OBJECT = "object"  # inside an object, waiting for its closing brace
    BETWEEN = "between"  # after a call: whitespace, maybe `;`, then another object or not
    TEXT = "text"  # not (or no longer) calls: everything is content


class Llama3JsonToolParser(SteppedParser):
    def __init__(self, new_id: IdSource | None = None) -> None:
        super().__init__(new_id)
        self._state = _State.BEGIN

    def finish(self) -> list[Event]:
        out: list[Event] = []
        blank = self._state is _State.BETWEEN and self._buf.strip() in ("", ";")
        if not blank:
            out += content(self._buf)
        self._buf = ""
        self._state = _State.TEXT
        return out

    def _step(self, out: list[Event]) -> bool:
        if self._state is _State.TEXT:
            out += content(self._buf)
            self._buf = ""
            return False
        if self._state is _State.OBJECT:
            return self._close(out)
        tag = PYTHON_TAG if self._state is _State.BEGIN else ";"
        start = find_opening(self._buf, tag, "{")
        if start is None:
            return False
        if start < 0:
            self._state = _State.TEXT
            return True
        self._state = _State.OBJECT
        self._open_structure(start)
        return True

    def _close(self, out: list[Event]) -> bool:
        end = self._structure_end()
        if end is None:
            return False
        call = call_from_object(load_json(self._buf[self._start : end]))
        if call is None:
            self._state = _State.TEXT
            return True
        out += self._call(*call)
        self._buf = self._buf[end:]
        self._state = _State.BETWEEN
        return True
