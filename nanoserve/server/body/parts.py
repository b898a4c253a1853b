"""The types the request models are built from: vLLM's lax scalars, the range annotations
the document carries, the models' common base, a chat message, and the bounds that depend on
the served model. They are apart from the models themselves (server/body/generation_models.py
and server/body/protocol.py) because every route's body is built from them, and reads alike
because of that.

The models check types and shapes the way vLLM's do (pydantic's lax mode), because clients
written against vLLM send what it takes: a boolean may come as `"true"`/`"false"`, `"1"`/`"0"`
(or pydantic's other spellings: yes/no, on/off, t/f, y/n, any case) or as 0/1; an integer as
`2.0` or `"2"`; a number as `"0.7"`. Two readings stay refused: a boolean where a number or a
count goes (vLLM takes `"n": true` for 1; OpenAI refuses it, and it is a client's bug, not a
request for one) and a number where a string goes (as in vLLM). The document states the
canonical types, what a client should send; the lax spellings are accepted, not promised.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictStr, WithJsonSchema
from pydantic_core import PydanticCustomError


def _not_a_bool(kind: str) -> BeforeValidator:
    def check(value: Any) -> Any:
        if isinstance(value, bool):  # before pydantic's lax mode reads true as 1
            raise PydanticCustomError("bool_type", f"Input should be {kind}, not a boolean")
        return value

    return BeforeValidator(check)


Bool = bool  # lax: also "true", "0", 1, ... (the module docstring)
Int = Annotated[int, _not_a_bool("an integer")]  # also 2.0 and "2"
# A JSON number, also "0.7"; float first, so that an integer past every double stays an int
# and reaches SamplingParams, whose message gives the range it is outside of.
Number = Annotated[float | int, _not_a_bool("a number"), WithJsonSchema({"type": "number"})]


def documented(**annotations: Any) -> Any:
    """Annotations for the document only (ranges and notes): they validate nothing here.
    SamplingParams and the engine check what they say, so each range has one owner."""
    return Field(json_schema_extra={k: v for k, v in annotations.items() if v is not None})


class Body(BaseModel):
    # Unknown fields are ignored (clients send vendor extras); the document leaves
    # additionalProperties open for them.
    model_config = ConfigDict(extra="ignore")


class TextPart(Body):
    type: Literal["text"]
    text: StrictStr


class CalledFunction(BaseModel):
    name: StrictStr
    arguments: Annotated[StrictStr, documented(description="a JSON object's text")]


class MessageToolCall(BaseModel):
    """A call an earlier assistant turn made (its result comes in a `tool` message)."""

    model_config = ConfigDict(extra="ignore")
    id: StrictStr
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(BaseModel):
    # Other keys (name, ...) reach the chat template as they came.
    model_config = ConfigDict(extra="allow")
    role: Annotated[StrictStr, documented(description="the chat template may refuse a role")]
    content: StrictStr | list[TextPart] | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: Annotated[StrictStr | None, documented(
        description="required in a tool message: the call it answers")] = None

    def as_dict(self) -> dict[str, Any]:
        """The message for the chat template: text parts joined, null content empty, and
        each tool call's arguments as an object where they are one (as transformers'
        templates take them, `arguments | tojson`; vLLM passes them so too)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        out = {**self.model_dump(exclude_none=True), "content": content or ""}
        for call in out.get("tool_calls", []):
            fn = call["function"]
            try:
                args = json.loads(fn["arguments"])
            except ValueError:
                continue
            if isinstance(args, dict):
                fn["arguments"] = args
        return out


MAX_TOKENS_NOTE = "prompt + max_tokens must fit max_model_len and the KV pool (else a 400)"


@dataclass(frozen=True, slots=True)
class Bounds:
    """The bounds that depend on the served model: the highest token id and max_tokens
    (None while the model is not loaded: the document then leaves them out)."""

    hi_id: int | None
    hi_tok: int | None

    @classmethod
    def of(cls, vocab: int | None, max_len: int | None) -> Bounds:
        """Token ids below `vocab`, max_tokens below `max_len`, once those are known."""
        return cls(None if vocab is None else vocab - 1, None if max_len is None else max_len - 1)

    def token_id(self) -> Any:
        """The annotation of a token id."""
        return documented(minimum=0, maximum=self.hi_id)

    def max_tokens(self) -> Any:
        """The annotation of max_tokens (and chat's max_completion_tokens)."""
        return documented(minimum=1, maximum=self.hi_tok, description=MAX_TOKENS_NOTE)
