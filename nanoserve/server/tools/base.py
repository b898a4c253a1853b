"""The parsers' common interface: events, tool calls, call ids, and the hold-back helpers.

A parser is fed the text of one choice in pieces and answers with events; it emits nothing
that later text could still turn into markup. Its decisions depend only on the characters
seen so far, never on where the pieces were cut, so the events of any chunking fold
(`collect`) to the same content and calls as the whole text parsed at once (`parse_all`).
That is the detokenizer's stop-string hold-back (vLLM holds back `len(stop) - 1` characters)
applied to the opening marker of a call: a trailing `<tool_` is held until the next piece
says whether it became `<tool_call>`, and released as content by `finish()` if it never did.
"""

from __future__ import annotations

import itertools
import json
import random
import string
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Content:
    """Text for the message's `content`."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    """A call begins: its place among the choice's calls, its id and the function's name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallArgs:
    """A piece of call `index`'s arguments, a JSON string once all pieces are joined."""

    index: int
    text: str


Event = Content | ToolCallStart | ToolCallArgs


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One whole call, as a unary response lists it; `arguments` is a JSON object's text."""

    id: str
    name: str
    arguments: str


IdSource = Callable[[], str]
_ALNUM = string.ascii_letters + string.digits


def random_ids(rng: random.Random | None = None) -> IdSource:
    """Ids as OpenAI writes them, `call_` and 24 letters or digits; pass a seeded
    `random.Random` for a repeatable sequence (the default draws from the OS)."""
    source = rng if rng is not None else random.SystemRandom()

    def new_id() -> str:
        return "call_" + "".join(source.choice(_ALNUM) for _ in range(24))

    return new_id


def sequential_ids(start: int = 0) -> IdSource:
    """`call_000...0`, `call_000...1`, ...: the same shape, for tests and replays."""
    counter = itertools.count(start)
    return lambda: f"call_{next(counter):024d}"


class ToolParser(ABC):
    """One choice's output -> content and tool calls, fed in pieces.

    `feed` returns the events that the text so far decides; `finish` (called once, at the
    end of the output) returns the rest, releasing any held-back text as content.
    """

    def __init__(self, new_id: IdSource | None = None) -> None:
        self._new_id = new_id if new_id is not None else random_ids()
        self._calls = 0

    @abstractmethod
    def feed(self, text: str) -> list[Event]: ...

    @abstractmethod
    def finish(self) -> list[Event]: ...

    def _call(self, name: str, arguments: str) -> list[Event]:
        index = self._calls
        self._calls += 1
        return [ToolCallStart(index, self._new_id(), name), ToolCallArgs(index, arguments)]


class SteppedParser(ToolParser):
    """A parser over a buffer: `feed` appends to it and lets `_step` take what the text so
    far decides, one decision at a time, until `_step` needs more text (returns False)."""

    def __init__(self, new_id: IdSource | None = None) -> None:
        super().__init__(new_id)
        self._buf = ""  # the text not yet decided
        self._gap = ""  # whitespace dropped before an opening marker, given back if rejected
        self._after_call = False  # drop the whitespace that follows a call
        self._start = 0  # where the open bracketed structure starts in the buffer
        self._scanned = 0  # how much of the buffer its nesting has seen
        self._nesting = Nesting()

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while self._step(out):
            pass
        return out

    @abstractmethod
    def _step(self, out: list[Event]) -> bool: ...

    def _text_until(self, marker: str, out: list[Event]) -> bool:
        """Content up to `marker` (blank after a call dropped, a possible start of the
        marker held back); True once the marker is found and the buffer is past it, the
        whitespace before it kept in `_gap` in case the markup is rejected."""
        if self._after_call:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._after_call = False
        start = self._buf.find(marker)
        if start < 0:
            keep = safe_prefix(self._buf, marker)
            out += content(self._buf[:keep])
            self._buf = self._buf[keep:]
            return False
        before = self._buf[:start].rstrip()
        out += content(before)
        self._gap = self._buf[len(before) : start]
        self._buf = self._buf[start + len(marker) :]
        return True

    def _open_structure(self, start: int) -> None:
        """A bracketed structure opens at buffer offset `start`."""
        self._start, self._scanned = start, start
        self._nesting = Nesting()

    def _structure_end(self) -> int | None:
        """The buffer offset just past the open structure's closing bracket, once the text
        so far has it (each character is scanned once, however the text was cut)."""
        end = self._nesting.end(self._buf[self._scanned :])
        if end is None:
            self._scanned = len(self._buf)
            return None
        return end + self._scanned


def content(text: str) -> list[Event]:
    """A content event, or none for empty text (a stream never carries empty deltas)."""
    return [Content(text)] if text else []


def collect(events: Iterable[Event]) -> tuple[str, list[ToolCall]]:
    """Fold events into (content, calls): what a unary response carries."""
    texts: list[str] = []
    starts: dict[int, ToolCallStart] = {}
    args: dict[int, list[str]] = {}
    for event in events:
        if isinstance(event, Content):
            texts.append(event.text)
        elif isinstance(event, ToolCallStart):
            starts[event.index] = event
            args[event.index] = []
        else:
            args[event.index].append(event.text)
    calls = [ToolCall(s.id, s.name, "".join(args[i])) for i, s in sorted(starts.items())]
    return "".join(texts), calls


def parse_all(
    parser_cls: Callable[[IdSource | None], ToolParser],
    text: str,
    new_id: IdSource | None = None,
) -> tuple[str, list[ToolCall]]:
    """The unary parse: the whole output in one piece."""
    parser = parser_cls(new_id)
    return collect(parser.feed(text) + parser.finish())


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`: the
    characters that might still become the marker."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def safe_prefix(text: str, marker: str) -> int:
    """How much of marker-free `text` is content whatever comes next: all but a possible
    start of the marker and the whitespace before it (whitespace next to markup is dropped)."""
    return len(text[: len(text) - partial_suffix(text, marker)].rstrip())


def find_opening(text: str, tag: str, opener: str) -> int | None:
    """Where `text` opens a structure written `ws [tag] ws opener ...`: the opener's index,
    -1 if it cannot be such a structure, None while undecided (blank, or a partial tag)."""
    rest = text.lstrip()
    if tag and rest.startswith(tag):
        rest = rest[len(tag) :].lstrip()
    elif tag and rest and tag.startswith(rest):
        return None
    if not rest:
        return None
    return len(text) - len(rest) if rest[0] == opener else -1


class Nesting:
    """Bracket depth over text fed in pieces, skipping quoted strings ('...' or "...",
    backslash escapes): finds where a JSON value or a Python list that opens with a bracket
    ends. Mismatched brackets only make it end early; the parse that follows rejects that."""

    __slots__ = ("depth", "escape", "quote")

    def __init__(self) -> None:
        self.depth = 0
        self.quote = ""
        self.escape = False

    def end(self, text: str) -> int | None:
        """Feed `text`; the offset just past the bracket that closes the outermost group."""
        for i, char in enumerate(text):
            if self.quote:
                if self.escape:
                    self.escape = False
                elif char == "\\":
                    self.escape = True
                elif char == self.quote:
                    self.quote = ""
            elif char in "\"'":
                self.quote = char
            elif char in "[({":
                self.depth += 1
            elif char in "])}":
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1
        return None


def call_from_object(obj: Any) -> tuple[str, str] | None:
    """A `{"name": ..., "arguments" | "parameters": {...}}` object -> (name, arguments JSON),
    or None if it is not one. Arguments given as a JSON string of an object are accepted;
    missing arguments are `{}`. The JSON is `json.dumps`'s default form, non-ASCII kept."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = load_json(args)
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    return name, json.dumps(args, ensure_ascii=False)


def load_json(text: str) -> Any:
    """The JSON value of `text`, or None where it is not JSON."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None
