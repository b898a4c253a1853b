"""Mistral tool calls: `[TOOL_CALLS]` and a JSON array of calls, or (newer templates, v11
on) `[TOOL_CALLS]` and a name, `[ARGS]` and the arguments object, once per call:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]f[ARGS]{}

Text before, between and after is content, less the whitespace that touches a call. What
follows a `[TOOL_CALLS]` and is not one of the two forms (an array that is not a list of
calls, a name that is not a word, arguments that are not an object) makes that marker
content, verbatim, and the text after it is read again as text.
"""

from __future__ import annotations

import re
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

MARKER = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_NAME = re.compile(r"\s*([\w.\-]*)")


class _State(Enum):
    TEXT = "text"
    MARKED = "marked"  # after the marker: an array or a name?
    ARRAY = "array"  # inside the array, waiting for its closing bracket
    ARGUMENTS = "arguments"  # after `name[ARGS]`: inside the object


class MistralToolParser(SteppedParser):
    def __init__(self, new_id: IdSource | None = None) -> None:
        super().__init__(new_id)
        self._state = _State.TEXT
        self._name = ""

    def finish(self) -> list[Event]:
        out: list[Event] = []
        while self._state is not _State.TEXT:
            self._reject(out)
            while self._step(out):
                pass
        if self._after_call:
            self._buf = self._buf.lstrip()
        out += content(self._buf)
        self._buf = ""
        return out

    def _step(self, out: list[Event]) -> bool:
        if self._state is _State.TEXT:
            return self._text(out)
        if self._state is _State.MARKED:
            return self._marked(out)
        return self._close(out)

    def _text(self, out: list[Event]) -> bool:
        if not self._text_until(MARKER, out):
            return False
        self._state = _State.MARKED
        return True

    def _marked(self, out: list[Event]) -> bool:
        start = find_opening(self._buf, "", "[")
        if start is None:
            return False
        if start >= 0:
            self._open(_State.ARRAY, start)
            return True
        match = _NAME.match(self._buf)
        assert match is not None  # the pattern matches the empty string
        rest = self._buf[match.end() :]
        if rest.startswith(ARGS) and match.group(1):
            self._name = match.group(1)
            start = find_opening(rest[len(ARGS) :], "", "{")
            if start is None:
                return False  # `[ARGS]` is here, its object not yet
            if start >= 0:
                self._open(_State.ARGUMENTS, len(self._buf) - len(rest) + len(ARGS) + start)
                return True
        elif ARGS.startswith(rest):
            return False  # the name, or `[ARGS]`, is still arriving
        self._reject(out)
        return True

    def _open(self, state: _State, start: int) -> None:
        self._state = state
        self._open_structure(start)

    def _close(self, out: list[Event]) -> bool:
        end = self._structure_end()
        if end is None:
            return False
        value = load_json(self._buf[self._start : end])
        if self._state is _State.ARGUMENTS:
            value = [{"name": self._name, "arguments": value}]
        calls = [call_from_object(v) for v in value] if isinstance(value, list) else []
        if not calls or None in calls:
            self._reject(out)
            return True
        for call in calls:
            assert call is not None
            out += self._call(*call)
        self._buf = self._buf[end:]
        self._state, self._after_call, self._gap = _State.TEXT, True, ""
        return True

    def _reject(self, out: list[Event]) -> None:
        """The marker opens no call: it is content, and what follows it is text again."""
        out += content(self._gap + MARKER)
        self._state, self._gap = _State.TEXT, ""
