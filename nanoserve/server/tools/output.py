"""A chat choice's generated text -> the assistant message's fields: `reasoning_content`,
`content` and `tool_calls`, streamed as OpenAI streams them and whole for a unary answer.

One `ChoiceOutput` per choice, made from the request's `OutputPlan`: the reasoning splitter
runs first (when the server has one), its content goes to the tool parser the request
calls for (the server's parser under `tool_choice` "auto", the constrained shapes under
"required" or a named function, none under "none"), and what is left is content. Each
`feed` returns the delta of one stream chunk; a unary answer is the same pieces joined,
so streamed and unary answers agree whatever the chunking.

Call ids are `call_` and 24 hex digits of a hash of the response id, the choice and the
call's place: unique per response, and the same in every replay of a recorded request.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from nanoserve.server.tools import TOOL_PARSERS
from nanoserve.server.tools.base import (
    Content,
    Event,
    IdSource,
    ToolCall,
    ToolCallArgs,
    ToolCallStart,
    ToolParser,
)
from nanoserve.server.tools.constrained import NamedCallParser, RequiredCallsParser
from nanoserve.server.tools.reasoning import REASONING_PARSERS, Reasoning, ReasoningParser

Json = dict[str, Any]


@dataclass(frozen=True, slots=True)
class OutputPlan:
    """How one request's choices are read: `mode` is the effective tool_choice ("none",
    "auto", "required", "named"), `parser` the tool-call parser under "auto", `name` the
    function under "named", `reasoning` the reasoning parser (None: no reasoning split)."""

    mode: str = "none"
    parser: str | None = None
    name: str | None = None
    reasoning: str | None = None

    def start(self, response_id: str, index: int) -> ChoiceOutput:
        return ChoiceOutput(self, _ids(response_id, index))


def _ids(response_id: str, index: int) -> IdSource:
    count = 0

    def new_id() -> str:
        nonlocal count
        digest = hashlib.sha256(f"{response_id}/{index}/{count}".encode()).hexdigest()
        count += 1
        return "call_" + digest[:24]

    return new_id


@dataclass(slots=True)
class Delta:
    """What one piece of text adds to the message."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[Json] = field(default_factory=list)  # OpenAI's delta.tool_calls items

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


class ChoiceOutput:
    """One choice's text in pieces -> deltas; what it read so far in `content`,
    `reasoning` (the pieces) and `calls()`."""

    def __init__(self, plan: OutputPlan, new_id: IdSource) -> None:
        self._reasoner: ReasoningParser | None = (
            REASONING_PARSERS[plan.reasoning]() if plan.reasoning else None)
        self._tools: ToolParser | None = None
        if plan.mode == "auto" and plan.parser:
            self._tools = TOOL_PARSERS[plan.parser](new_id)
        elif plan.mode == "named" and plan.name:
            self._tools = NamedCallParser(plan.name, new_id)
        elif plan.mode == "required":
            self._tools = RequiredCallsParser(new_id)
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self._calls: dict[int, list[str]] = {}  # index -> [id, name, arguments...]

    @property
    def has_calls(self) -> bool:
        return bool(self._calls)

    def feed(self, text: str) -> Delta:
        return self._fold(self._split(text, final=False))

    def finish(self) -> Delta:
        return self._fold(self._split("", final=True))

    def calls(self) -> list[ToolCall]:
        return [ToolCall(c[0], c[1], "".join(c[2:])) for _, c in sorted(self._calls.items())]

    def _split(self, text: str, final: bool) -> list[Event | Reasoning]:
        parts: list[Event | Reasoning] = []
        if self._reasoner is None:
            parts.append(Content(text))
        else:
            parts.extend(self._reasoner.feed(text))
            if final:
                parts.extend(self._reasoner.finish())
        if self._tools is None:
            return parts
        out: list[Event | Reasoning] = []
        for p in parts:
            out.extend(self._tools.feed(p.text) if isinstance(p, Content) else [p])
        if final:
            out.extend(self._tools.finish())
        return out

    def _fold(self, events: list[Event | Reasoning]) -> Delta:
        d = Delta()
        for e in events:
            if isinstance(e, Reasoning):
                d.reasoning += e.text
            elif isinstance(e, Content):
                d.content += e.text
            elif isinstance(e, ToolCallStart):
                self._calls[e.index] = [e.id, e.name]
                d.tool_calls.append({"index": e.index, "id": e.id, "type": "function",
                                     "function": {"name": e.name, "arguments": ""}})
            elif isinstance(e, ToolCallArgs):
                self._calls[e.index].append(e.text)
                last = d.tool_calls[-1] if d.tool_calls else None
                if last is not None and last["index"] == e.index:  # one entry a call a chunk
                    last["function"]["arguments"] += e.text
                else:
                    d.tool_calls.append({"index": e.index, "function": {"arguments": e.text}})
        self.content.append(d.content)
        self.reasoning.append(d.reasoning)
        return d


def delta_json(d: Delta, first: bool) -> Json:
    """A stream chunk's `delta` for what a piece of text added: the role on a choice's
    first chunk, then content, reasoning_content and tool_calls where there are some."""
    delta: Json = {"role": "assistant"} if first else {}
    if d.content or (first and not d.reasoning and not d.tool_calls):
        delta["content"] = d.content
    if d.reasoning:
        delta["reasoning_content"] = d.reasoning
    if d.tool_calls:
        delta["tool_calls"] = d.tool_calls
    return delta


def message_json(out: ChoiceOutput, text: str, reasoning: bool) -> Json:
    """A unary answer's message: the whole `text` read by `out` (a fresh ChoiceOutput) as
    the stream reads it; content null where there are calls and nothing else, as OpenAI's."""
    out.feed(text)
    out.finish()
    content = "".join(out.content)
    calls = out.calls()
    msg: Json = {"role": "assistant", "content": content or (None if calls else "")}
    if reasoning:
        msg["reasoning_content"] = "".join(out.reasoning) or None
    if calls:
        msg["tool_calls"] = [{"id": k.id, "type": "function", "function": {
            "name": k.name, "arguments": k.arguments}} for k in calls]
    return msg
