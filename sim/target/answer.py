"""What an answer says, read the same way from a unary body and from a stream's frames.

Completions carry `text` and, with `logprobs`, the legacy `{"tokens": [...]}`; chat carries
`message.content` (unary) or `delta.content` (stream) and `logprobs.content[i].token`. A
stream's choices are joined by their `index`, as OpenAI's clients do.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sim.target.wire import Seen


@dataclass(slots=True)
class Choice:
    text: str = ""
    tokens: list[str] | None = None  # from logprobs, where the server gave them
    finish_reason: str | None = None


@dataclass(slots=True)
class Answer:
    choices: dict[int, Choice]
    usage: dict[str, Any] | None
    error: str | None  # an error object's message (a unary error, or an error frame)

    def text(self, index: int = 0) -> str:
        c = self.choices.get(index)
        return c.text if c is not None else ""

    def tokens(self, index: int = 0) -> list[str] | None:
        c = self.choices.get(index)
        return c.tokens if c is not None else None

    def finish_reason(self, index: int = 0) -> str | None:
        c = self.choices.get(index)
        return c.finish_reason if c is not None else None


def read(seen: Seen) -> Answer:
    if seen.frames or (seen.stream and seen.json is None):
        return _from_frames(seen)
    obj = seen.json if isinstance(seen.json, dict) else {}
    choices: dict[int, Choice] = {}
    for i, ch in _choices(obj):
        msg = ch.get("message")
        text = msg.get("content") if isinstance(msg, dict) else ch.get("text")
        choices[i] = Choice(text if isinstance(text, str) else "", _tokens(ch.get("logprobs")),
                            ch.get("finish_reason"))
    usage = obj.get("usage")
    return Answer(choices, usage if isinstance(usage, dict) else None, error_message(obj))


def error_message(obj: Any) -> str | None:
    """An error object's message: OpenAI's `{"error": {"message": "..."}}`, or the top-level
    `{"object": "error", "message": "..."}` of older vLLM; None otherwise."""
    if not isinstance(obj, dict):
        return None
    err = obj.get("error") if isinstance(obj.get("error"), dict) else (
        obj if obj.get("object") == "error" else None)
    msg = err.get("message") if err is not None else None
    return msg if isinstance(msg, str) else None


def _from_frames(seen: Seen) -> Answer:
    choices: dict[int, Choice] = {}
    usage: dict[str, Any] | None = None
    error = None
    for frame in seen.frames:
        obj = frame.obj or {}
        error = error or error_message(obj)
        if isinstance(obj.get("usage"), dict):
            usage = obj["usage"]
        for i, ch in _choices(obj):
            c = choices.setdefault(i, Choice())
            c.text += delta_text(ch)
            toks = _tokens(ch.get("logprobs"))
            if toks is not None:
                c.tokens = (c.tokens or []) + toks
            c.finish_reason = ch.get("finish_reason") or c.finish_reason
    return Answer(choices, usage, error)


def frame_text(obj: dict[str, Any] | None) -> str:
    """The text a stream frame adds, over all its choices."""
    return "".join(delta_text(c) for c in choice_list(obj))


def choice_list(obj: Any) -> list[Any]:
    choices = obj.get("choices") if isinstance(obj, dict) else None
    return choices if isinstance(choices, list) else []


def delta_text(choice: Any) -> str:
    if not isinstance(choice, dict):
        return ""
    delta = choice.get("delta")
    piece = delta.get("content") if isinstance(delta, dict) else choice.get("text")
    return piece if isinstance(piece, str) else ""


def _choices(obj: dict[str, Any]) -> Iterator[tuple[int, dict[str, Any]]]:
    for k, ch in enumerate(choice_list(obj)):
        if isinstance(ch, dict):
            index = ch.get("index")
            yield (index if isinstance(index, int) else k), ch


def _tokens(logprobs: Any) -> list[str] | None:
    if not isinstance(logprobs, dict):
        return None
    if isinstance(logprobs.get("tokens"), list):  # completions' legacy shape
        return [str(t) for t in logprobs["tokens"]]
    content = logprobs.get("content")
    if isinstance(content, list):  # chat's shape (llama-server uses it for completions too)
        return [str(e.get("token", "")) for e in content if isinstance(e, dict)]
    return None
