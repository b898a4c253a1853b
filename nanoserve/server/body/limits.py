"""The limits on a request's size that are checked before the work they bound.

A body of 10,000 tools or a megabyte of prompt costs seconds of parsing, templating and
tokenizing before the engine sees a token of it. That work runs off the event loop
(offload.py), so it stalls nobody else; these limits keep it from being asked for at all
where the answer would be a 400 anyway (a prompt that cannot fit the context) or where
OpenAI's API sets the bound (128 tools). Each is measured cheaply, before the costly step
it guards: the tools by count, before the request model validates them; the prompt's
characters, before the template and the tokenizer run; the template's output, before it is
tokenized. The 400 names the field and the limit, so a client knows what to shrink.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nanoserve.server.body.parts import Message
from nanoserve.server.errors import bad_request
from nanoserve.server.settings import RequestLimits


@dataclass(frozen=True, slots=True)
class Caps:
    """RequestLimits resolved against the served model's context."""

    tools: int
    prompt_chars: int
    template_chars: int

    @classmethod
    def of(cls, limits: RequestLimits, max_model_len: int) -> Caps:
        return cls(limits.max_tools, limits.prompt_chars(max_model_len),
                   limits.template_chars(max_model_len))


def check_tools(body: Mapping[str, Any], caps: Caps | None) -> None:
    """Before validation: pydantic's cost grows with every tool, and the count is free."""
    tools = body.get("tools")
    if caps is not None and isinstance(tools, list) and len(tools) > caps.tools:
        raise bad_request("tools", f"tools has {len(tools)} entries, over this server's "
                          f"limit of {caps.tools} (max_tools)", "too_many_tools")


def check_prompt_chars(field: str, chars: int, caps: Caps | None) -> None:
    if caps is not None and chars > caps.prompt_chars:
        raise bad_request(field, f"{field} has {chars} characters, over this server's limit "
                          f"of {caps.prompt_chars} (max_prompt_chars): it cannot fit the "
                          "model's context", "prompt_too_long")


def check_template_chars(text: str, caps: Caps | None) -> None:
    """After the template, before the tokenizer: tools' descriptions and schemas count here,
    which the messages' characters did not."""
    if caps is not None and len(text) > caps.template_chars:
        raise bad_request("messages", f"the chat template's output has {len(text)} "
                          f"characters (messages and tools), over this server's limit of "
                          f"{caps.template_chars} (max_template_chars): it cannot fit the "
                          "model's context", "prompt_too_long")


def message_chars(messages: Sequence[Message]) -> int:
    """The text of the messages the template will render: contents and tool-call arguments."""
    total = 0
    for m in messages:
        if isinstance(m.content, str):
            total += len(m.content)
        elif m.content is not None:
            total += sum(len(p.text) for p in m.content)
        for call in m.tool_calls or ():
            total += len(call.function.arguments)
    return total
