"""The request bodies of the API as pydantic models: what parse checks, and what
`/openapi.json` documents, declared once. This module assembles one served model's set
(the generation routes' from server/body/generation_models.py, the tokenizer routes' here, all
built from server/body/parts.py), validates a body with it, and writes its JSON schemas.

The models check types and shapes the way vLLM's do (lax: server/body/parts.py says how).
A failure is a 400 whose `param` is the path of the bad value (`messages[0].role`,
`response_format.json_schema.name`), or the field when several of its items are bad; the
message names each of them (a few, then how many more). Value ranges
stay where the library's own users meet them, in `SamplingParams` (and the engine, for what
needs the model: token ids against the vocabulary, prompt plus max_tokens against the
context), whose messages name the field and the allowed range; the models carry those
ranges, from the same constants, as schema annotations only, so the document states them
and tests/test_openapi.py checks that it agrees with the validators at every boundary.

Some bounds depend on the served model (the vocabulary, max_model_len), so the models are
built per (served name, vocab, max_model_len) and cached: an app builds its set once the
engine is up, and the document without those bounds before.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictStr, ValidationError
from pydantic.json_schema import GenerateJsonSchema

from nanoserve.server.body.generation_models import generation_models
from nanoserve.server.body.invalid import api_error
from nanoserve.server.body.parts import Body, Bool, Bounds, Int, Message, documented

Schema = dict[str, Any]

# Where a failing shape deserves more words than pydantic's message about one alternative.
SHAPES = {
    "prompt": "a non-empty string, a list of strings, a list of token ids, or a list of such "
              "lists",
    "stop": "a string or a list of strings",
    "messages": "a non-empty list of {role, content} objects, content a string, a list of "
                "text parts, or null",
    "logit_bias": "an object of token id (a decimal string) -> number",
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Protocol:
    """The request models of one served model."""

    served: str  # the one `model` a body may name
    completion: type[BaseModel]
    chat: type[BaseModel]
    tokenize: type[BaseModel]
    detokenize: type[BaseModel]

    def by_path(self) -> dict[str, type[BaseModel]]:
        return {"/v1/completions": self.completion, "/v1/chat/completions": self.chat,
                "/tokenize": self.tokenize, "/detokenize": self.detokenize}


@functools.lru_cache(maxsize=16)
def protocol(served: str, vocab: int | None = None, max_len: int | None = None) -> Protocol:
    """The models for `served` (the only `model` a body may name); token ids below `vocab`
    and max_tokens below `max_len` once those are known."""
    b = Bounds.of(vocab, max_len)
    return Protocol(served, *generation_models(served, b), *_tokenizer_models(served, b))


def _tokenizer_models(served: str, b: Bounds) -> tuple[type[Body], type[Body]]:
    """/tokenize's and /detokenize's bodies."""
    TokenId = Annotated[Int, b.token_id()]  # noqa: N806
    TokenIds = Annotated[list[TokenId], Field(min_length=1)]  # noqa: N806

    class Tokenize(Body):
        """prompt, or messages (which win)."""

        model_config = ConfigDict(title="TokenizeRequest", json_schema_extra={"anyOf": [
            {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
            {"required": ["messages"], "properties": {
                "messages": {"type": "array"}}}]})
        model: Annotated[StrictStr | None, documented(enum=[served])] = None
        prompt: StrictStr | None = None
        messages: Annotated[list[Message], Field(min_length=1)] | None = None
        add_generation_prompt: Bool | None = None
        add_special_tokens: Bool | None = None
        return_token_strs: Bool | None = None

    class Detokenize(Body):
        """Token ids back to text."""

        model_config = ConfigDict(title="DetokenizeRequest")
        model: Annotated[StrictStr | None, documented(enum=[served])] = None
        tokens: TokenIds

    return Tokenize, Detokenize


# Errors name a field as SamplingParams does where the API has another name for it (the
# chat API's max_completion_tokens becomes max_tokens), so every field's errors read alike.
PARAM_NAMES = {"max_completion_tokens": "max_tokens"}


def validate(model: type[BaseModel], body: Mapping[str, Any]) -> Any:
    """`body` as an instance of `model`, or the 400 naming its first bad field (each of
    its bad items, server/body/invalid.py)."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise api_error(model, exc.errors(include_url=False), names=PARAM_NAMES,
                        shapes=SHAPES) from None


class _NoFieldTitles(GenerateJsonSchema):
    """Titles on every property ("Top P") say nothing a name does not."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


def request_schemas(served: str, vocab: int | None, max_len: int | None) -> dict[str, Schema]:
    """The JSON schema of each POST route's body, by path; each stands alone (the models'
    shared parts are written inline: none of them is recursive)."""
    out: dict[str, Schema] = {}
    for path, model in protocol(served, vocab, max_len).by_path().items():
        s = model.model_json_schema(schema_generator=_NoFieldTitles)
        defs = s.pop("$defs", {})
        out[path] = _inline(s, defs)
    return out


def _inline(node: Any, defs: dict[str, Schema]) -> Any:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            target = _inline(defs[ref.removeprefix("#/$defs/")], defs)
            return {**target, **{k: _inline(v, defs) for k, v in node.items() if k != "$ref"}}
        return {k: _inline(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    return node
