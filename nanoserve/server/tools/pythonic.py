"""Pythonic tool calls (Llama 3.2 and Llama 4 templates): the output is a Python list of
calls with keyword arguments, optionally inside Llama 4's `<|python_start|>` ... `<|python_end|>`:

    [get_weather(city="Paris", days=3), search(query='rain', filters={"lang": "en"})]

The list is read with `ast`, never evaluated: each element must be a call of a (dotted)
name with keyword arguments only, each a literal (`ast.literal_eval`), which become the
arguments' JSON object (tuples become arrays; sets, bytes, complex numbers and NaN make it
unreadable). An output that does not open with `[` (after the tag) is content throughout,
as is a list that does not read so, and everything after it. After the calls, whitespace and
`<|python_end|>` are dropped and the rest is content.
"""

from __future__ import annotations

import ast
import json
from enum import Enum

from nanoserve.server.tools.base import (
    Event,
    IdSource,
    SteppedParser,
    content,
    find_opening,
)

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"


class _State(Enum):
    BEGIN = "begin"  # whitespace, maybe the start tag, before the list
    LIST = "list"  # inside the list, waiting for its closing bracket
    AFTER = "after"  # after the calls: whitespace and the end tag are dropped
    TAIL = "tail"  # after the end tag: whitespace is dropped
    TEXT = "text"  # everything is content


class PythonicToolParser(SteppedParser):
    def __init__(self, new_id: IdSource | None = None) -> None:
        super().__init__(new_id)
        self._state = _State.BEGIN

    def finish(self) -> list[Event]:
        if self._state is _State.AFTER and PYTHON_END.startswith(self._buf.lstrip()):
            self._buf = ""  # only whitespace, or a cut-off end tag
        out = content(self._buf)
        self._buf = ""
        self._state = _State.TEXT
        return out

    def _step(self, out: list[Event]) -> bool:
        if self._state is _State.BEGIN:
            start = find_opening(self._buf, PYTHON_START, "[")
            if start is None:
                return False
            self._state = _State.LIST if start >= 0 else _State.TEXT
            self._open_structure(start)
            return True
        if self._state is _State.LIST:
            return self._close(out)
        if self._state is _State.AFTER:
            rest = self._buf.lstrip()
            if PYTHON_END.startswith(rest):
                return False  # blank so far, or the end tag arriving
            if rest.startswith(PYTHON_END):
                self._buf, self._state = rest[len(PYTHON_END) :], _State.TAIL
            else:
                self._buf, self._state = rest, _State.TEXT
            return True
        if self._state is _State.TAIL:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._state = _State.TEXT
        out += content(self._buf)
        self._buf = ""
        return False

    def _close(self, out: list[Event]) -> bool:
        end = self._structure_end()
        if end is None:
            return False
        calls = read_calls(self._buf[self._start : end])
        if calls is None:
            self._state = _State.TEXT
            return True
        for call in calls:
            out += self._call(*call)
        self._buf = self._buf[end:]
        self._state = _State.AFTER
        return True


def read_calls(source: str) -> list[tuple[str, str]] | None:
    """`[f(a=1), g.h(b="x")]` -> [(name, arguments JSON)], or None if it is not such a list."""
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        name = _dotted(node.func) if isinstance(node, ast.Call) else None
        if name is None or not isinstance(node, ast.Call) or node.args:
            return None
        if any(keyword.arg is None for keyword in node.keywords):
            return None  # **kwargs
        try:
            args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            calls.append((name, json.dumps(args, ensure_ascii=False, allow_nan=False)))
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
    return calls


def _dotted(node: ast.expr) -> str | None:
    """`f` or `a.b.f` as a name; None for anything else (a call's result, a subscript)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None
