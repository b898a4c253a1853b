"""Reasoning content: `<think> ... </think>` split off the output, in pieces.

    deepseek_r1  DeepSeek-R1 and its distills. Their templates end the prompt with `<think>`,
                 so the output may or may not repeat it: everything up to `</think>` is
                 reasoning, and an output that never closes it is all reasoning (it was
                 cut off while thinking).
    qwen3        Qwen3 (QwQ alike). Reasoning only if the output opens with `<think>`; with
                 thinking off the template puts the empty think block in the prompt and the
                 output is all content. An unclosed `<think>` is reasoning to the end.

Whitespace that touches a tag is dropped (the `\\n` after `<think>`, the `\\n\\n` after
`</think>`), so it is held back the same way as a tag that may be forming. `reasoning_ended`
turns true the moment the text fed so far has closed the reasoning (or, for qwen3, shown
that there is none): from there on a guided-decoding grammar applies to what follows.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from nanoserve.server.tools.base import Content, safe_prefix

OPEN = "<think>"
CLOSE = "</think>"


@dataclass(frozen=True, slots=True)
class Reasoning:
    """Text for the message's `reasoning_content`."""

    text: str


ReasoningEvent = Reasoning | Content


class _State(Enum):
    BEGIN = "begin"  # whitespace or a `<think>` forming: is this reasoning?
    THINKING = "thinking"
    ANSWER = "answer"  # after `</think>`, or no reasoning at all


class ReasoningParser:
    """One choice's output -> reasoning and content, fed in pieces (`feed`, then `finish`)."""

    # True for qwen3: only an opening `<think>` makes reasoning.
    requires_open = False

    def __init__(self) -> None:
        self._buf = ""
        self._state = _State.BEGIN
        self._strip = True  # drop the whitespace that starts the current part

    @property
    def reasoning_ended(self) -> bool:
        """Whether what follows is content (the reasoning is closed, or there is none)."""
        return self._state is _State.ANSWER

    def feed(self, text: str) -> list[ReasoningEvent]:
        self._buf += text
        out: list[ReasoningEvent] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[ReasoningEvent]:
        if self._state is _State.BEGIN:
            # Only whitespace or part of `<think>` came: no reasoning was opened.
            self._state, self._strip = _State.ANSWER, False
            if not self.requires_open:
                return _part(Reasoning, self._buf.lstrip())
        text, self._buf = self._buf, ""
        if self._strip:
            text = text.lstrip()
        return _part(Reasoning if self._state is _State.THINKING else Content, text)

    def _step(self, out: list[ReasoningEvent]) -> bool:
        if self._state is _State.BEGIN:
            rest = self._buf.lstrip()
            if rest.startswith(OPEN):
                self._buf, self._state = rest[len(OPEN) :], _State.THINKING
            elif OPEN.startswith(rest):
                return False  # blank, or `<think>` still arriving
            elif self.requires_open:
                self._state, self._strip = _State.ANSWER, False
            else:
                self._state = _State.THINKING
            return True
        if self._strip:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._strip = False
        if self._state is _State.ANSWER:
            out += _part(Content, self._buf)
            self._buf = ""
            return False
        end = self._buf.find(CLOSE)
        if end < 0:
            keep = safe_prefix(self._buf, CLOSE)
            out += _part(Reasoning, self._buf[:keep])
            self._buf = self._buf[keep:]
            return False
        out += _part(Reasoning, self._buf[:end].rstrip())
        self._buf = self._buf[end + len(CLOSE) :]
        self._state, self._strip = _State.ANSWER, True
        return True


class DeepSeekR1ReasoningParser(ReasoningParser):
    requires_open = False


class Qwen3ReasoningParser(ReasoningParser):
    requires_open = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def _part(kind: type[Reasoning] | type[Content], text: str) -> list[ReasoningEvent]:
    return [kind(text)] if text else []


def collect_reasoning(events: Iterable[ReasoningEvent]) -> tuple[str, str]:
    """Fold events into (reasoning_content, content)."""
    events = list(events)
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
    answer = "".join(e.text for e in events if isinstance(e, Content))
    return reasoning, answer


def split_all(parser_cls: type[ReasoningParser], text: str) -> tuple[str, str]:
    """The unary split: (reasoning_content, content) of the whole output."""
    parser = parser_cls()
    return collect_reasoning(parser.feed(text) + parser.finish())
