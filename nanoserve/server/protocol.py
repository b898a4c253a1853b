"""The request bodies of the API as pydantic models: what parse checks, and what
`/openapi.json` documents, declared once.

The models check types and shapes the way vLLM's do (pydantic's lax mode), because clients
written against vLLM send what it takes: a boolean may come as `"true"`/`"false"`, `"1"`/`"0"`
(or pydantic's other spellings: yes/no, on/off, t/f, y/n, any case) or as 0/1; an integer as
`2.0` or `"2"`; a number as `"0.7"`. Two readings stay refused: a boolean where a number or a
count goes (vLLM takes `"n": true` for 1; OpenAI refuses it, and it is a client's bug, not a
request for one) and a number where a string goes (as in vLLM). The document states the
canonical types, what a client should send; the lax spellings are accepted, not promised.
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
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictStr,
    ValidationError,
    WithJsonSchema,
)
from pydantic.json_schema import GenerateJsonSchema
from pydantic_core import PydanticCustomError

from nanoserve.sampling.params import (
    MAX_ABS_LOGIT_BIAS,
    MAX_ABS_PENALTY,
    MAX_LOGPROBS,
    MAX_N,
    MAX_SEED,
    MIN_SEED,
)
from nanoserve.sampling.params import MAX_STOP_STRINGS as MAX_STOP
from nanoserve.server.invalid import api_error

Schema = dict[str, Any]


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
# Where a failing shape deserves more words than pydantic's message about one alternative.
SHAPES = {
    "prompt": "a non-empty string, a list of strings, a list of token ids, or a list of such "
              "lists",
    "stop": "a string or a list of strings",
    "messages": "a non-empty list of {role, content} objects, content a string, a list of "
                "text parts, or null",
    "logit_bias": "an object of token id (a decimal string) -> number",
}  # fmt: skip


def schema(**annotations: Any) -> Any:
    """Annotations for the document only (ranges and notes): SamplingParams and the engine
    check what they say."""
    return Field(json_schema_extra={k: v for k, v in annotations.items() if v is not None})


class _Body(BaseModel):
    # Unknown fields are ignored (clients send vendor extras); the document leaves
    # additionalProperties open for them.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: Bool | None = None
    continuous_usage_stats: Annotated[Bool | None, schema(
        description="with include_usage: usage on every chunk (vLLM's)")] = None


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    # Other keys (name, ...) reach the chat template as they came.
    model_config = ConfigDict(extra="allow")
    role: Annotated[StrictStr, schema(description="the chat template may refuse a role")]
    content: StrictStr | list[TextPart] | None = None

    def as_dict(self) -> dict[str, Any]:
        """The message for the chat template: text parts joined, null content empty."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        return {**self.model_dump(), "content": content or ""}


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`: the schema the output must validate against
    (`strict` is accepted and always honoured: the output is constrained either way)."""

    model_config = ConfigDict(extra="forbid")
    name: Annotated[StrictStr, Field(min_length=1, max_length=64)]
    description: StrictStr | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: Bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Annotated[JsonSchemaFormat | None, schema(
        description="required with type json_schema")] = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: one of json, regex, choice or grammar."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | StrictStr | None = Field(default=None, alias="json")
    regex: Annotated[StrictStr | None, Field(min_length=1)] = None
    choice: Annotated[list[Annotated[StrictStr, Field(min_length=1)]] | None,
                      Field(min_length=1)] = None
    grammar: Annotated[StrictStr | None, Field(min_length=1)] = None


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
    b = _Bounds(None if vocab is None else vocab - 1, None if max_len is None else max_len - 1)
    sampling = _sampling_model(served, b)
    return Protocol(served, *_generation_models(sampling, b), *_tokenizer_models(served, b))


@dataclass(frozen=True, slots=True)
class _Bounds:
    """The bounds that depend on the served model: the highest token id and max_tokens."""

    hi_id: int | None
    hi_tok: int | None


MAX_TOKENS_NOTE = "prompt + max_tokens must fit max_model_len and the KV pool (else a 400)"


def _sampling_model(served: str, b: _Bounds) -> type[_Body]:
    """The fields every generation request shares: those copied into SamplingParams."""
    TokenId = Annotated[Int, schema(minimum=0, maximum=b.hi_id)]  # noqa: N806
    MaxTokens = Annotated[Int | None, schema(  # noqa: N806
        minimum=1, maximum=b.hi_tok, description=MAX_TOKENS_NOTE)]
    pen = schema(minimum=-MAX_ABS_PENALTY, maximum=MAX_ABS_PENALTY)
    # Keys are token ids: pydantic would write a key pattern as patternProperties, which
    # leaves other keys open, so this schema is spelled out.
    LogitBias = Annotated[dict[StrictStr, Number], WithJsonSchema({  # noqa: N806
        "type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
        "additionalProperties": {"type": "number", "minimum": -MAX_ABS_LOGIT_BIAS,
                                 "maximum": MAX_ABS_LOGIT_BIAS}})]
    StopStr = Annotated[StrictStr, schema(minLength=1)]  # noqa: N806
    Refused = Annotated[None, schema(description="not supported: any value is a 400")]  # noqa: N806

    class Sampling(_Body):
        """The fields copied into SamplingParams, with its ranges (nanoserve/sampling/params.py)."""

        model: Annotated[StrictStr | None, schema(enum=[served])] = None
        n: Annotated[Int | None, schema(minimum=1, maximum=MAX_N)] = None
        temperature: Annotated[Number | None, schema(minimum=0, description="0 is greedy")] = None
        top_p: Annotated[Number | None, schema(exclusiveMinimum=0, maximum=1)] = None
        top_k: Annotated[Int | None, schema(minimum=-1, description="0 or -1: off")] = None
        min_p: Annotated[Number | None, schema(minimum=0, maximum=1)] = None
        seed: Annotated[Int | None, schema(minimum=MIN_SEED, maximum=MAX_SEED)] = None
        max_tokens: MaxTokens = None
        min_tokens: Annotated[Int | None, schema(minimum=0,
                                                       description="at most max_tokens")] = None
        ignore_eos: Bool | None = None
        stop_token_ids: list[TokenId] | None = None
        stop: Annotated[StopStr | Annotated[list[StopStr], schema(maxItems=MAX_STOP)] | None,
                        Field(union_mode="left_to_right")] = None
        include_stop_str_in_output: Bool | None = None
        skip_special_tokens: Bool | None = None
        presence_penalty: Annotated[Number | None, pen] = None
        frequency_penalty: Annotated[Number | None, pen] = None
        repetition_penalty: Annotated[Number | None, schema(exclusiveMinimum=0)] = None
        logit_bias: Annotated[LogitBias | None, schema(
            description="token id (a decimal string) -> bias")] = None
        stream: Bool | None = None
        stream_options: Annotated[StreamOptions | None,
                                  schema(description="only with stream: true")] = None
        tools: Refused = None
        tool_choice: Refused = None
        functions: Refused = None
        function_call: Refused = None
        suffix: Refused = None
        # vLLM's extras for scoring (lm-evaluation-harness's loglikelihood) and tracing.
        prompt_logprobs: Annotated[Int | None, schema(
            minimum=0, maximum=MAX_LOGPROBS, description="vLLM's: each prompt token's "
            "logprob and this many alternatives (the first token's entry is null)")] = None
        return_token_ids: Annotated[Bool | None, schema(
            description="vLLM's: prompt_token_ids and token_ids in the answer")] = None
        # Structured outputs (nanoserve/sampling/grammar.py): at most one of these per request.
        response_format: ResponseFormat | None = None
        guided_json: dict[str, Any] | StrictStr | None = None
        guided_regex: Annotated[StrictStr | None, Field(min_length=1)] = None
        guided_choice: Annotated[list[Annotated[StrictStr, Field(min_length=1)]] | None,
                                 Field(min_length=1)] = None
        guided_grammar: Annotated[StrictStr | None, Field(min_length=1)] = None
        structured_outputs: StructuredOutputs | None = None

    return Sampling


def _generation_models(sampling: type[_Body], b: _Bounds) -> tuple[type[_Body], type[_Body]]:
    """Completion and Chat, each the shared fields plus its own."""
    TokenId = Annotated[Int, schema(minimum=0, maximum=b.hi_id)]  # noqa: N806
    TokenIds = Annotated[list[TokenId], Field(min_length=1)]  # noqa: N806
    MaxTokens = Annotated[Int | None, schema(  # noqa: N806
        minimum=1, maximum=b.hi_tok, description=MAX_TOKENS_NOTE)]
    Text = Annotated[StrictStr, Field(min_length=1)]  # noqa: N806

    # The base is built per served model (its bounds), which mypy cannot follow.
    class Completion(sampling):  # type: ignore[misc,valid-type]
        """A completion; each prompt string is tokenized and must be non-empty."""

        model_config = ConfigDict(title="CompletionRequest")
        prompt: (Text | Annotated[list[Text], Field(min_length=1)] | TokenIds
                 | Annotated[list[TokenIds], Field(min_length=1)])
        echo: Bool | None = None
        logprobs: Annotated[Int | None, schema(minimum=0, maximum=MAX_LOGPROBS)] = None
        best_of: Annotated[Int | None, schema(minimum=1, maximum=MAX_N,
                                                    description="must equal n")] = None

    class Chat(sampling):  # type: ignore[misc,valid-type]
        """A chat completion; messages go through the chat template."""

        model_config = ConfigDict(title="ChatCompletionRequest")
        messages: Annotated[list[Message], Field(min_length=1)]
        add_generation_prompt: Bool | None = None
        max_completion_tokens: MaxTokens = None
        logprobs: Bool | None = None
        top_logprobs: Annotated[Int | None, schema(
            minimum=0, maximum=MAX_LOGPROBS, description="needs logprobs: true")] = None

    return Completion, Chat


def _tokenizer_models(served: str, b: _Bounds) -> tuple[type[_Body], type[_Body]]:
    """/tokenize's and /detokenize's bodies."""
    TokenId = Annotated[Int, schema(minimum=0, maximum=b.hi_id)]  # noqa: N806
    TokenIds = Annotated[list[TokenId], Field(min_length=1)]  # noqa: N806

    class Tokenize(_Body):
        """prompt, or messages (which win)."""

        model_config = ConfigDict(title="TokenizeRequest", json_schema_extra={"anyOf": [
            {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
            {"required": ["messages"], "properties": {
                "messages": {"type": "array"}}}]})
        model: Annotated[StrictStr | None, schema(enum=[served])] = None
        prompt: StrictStr | None = None
        messages: Annotated[list[Message], Field(min_length=1)] | None = None
        add_generation_prompt: Bool | None = None
        add_special_tokens: Bool | None = None
        return_token_strs: Bool | None = None

    class Detokenize(_Body):
        """Token ids back to text."""

        model_config = ConfigDict(title="DetokenizeRequest")
        model: Annotated[StrictStr | None, schema(enum=[served])] = None
        tokens: TokenIds

    return Tokenize, Detokenize


# Errors name a field as SamplingParams does where the API has another name for it (the
# chat API's max_completion_tokens becomes max_tokens), so every field's errors read alike.
PARAM_NAMES = {"max_completion_tokens": "max_tokens"}


def validate(model: type[BaseModel], body: Mapping[str, Any]) -> Any:
    """`body` as an instance of `model`, or the 400 naming its first bad field (each of
    its bad items, server/invalid.py)."""
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
