"""The bodies of the generation routes (`/v1/completions`, `/v1/chat/completions`): the
fields every generation request shares, those SamplingParams takes, with its ranges
(nanoserve/sampling/params.py), and each route's own.

They are apart from protocol.py, which assembles one served model's set of models and
validates with them, because they are most of the API's surface: the sampling fields, vLLM's
extras and the structured-output objects. Built per served model (its name and bounds, see
parts.Bounds); protocol() caches them.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr, WithJsonSchema

from nanoserve.sampling.params import (
    MAX_ABS_LOGIT_BIAS,
    MAX_ABS_PENALTY,
    MAX_LOGPROBS,
    MAX_N,
    MAX_SEED,
    MIN_SEED,
)
from nanoserve.sampling.params import MAX_STOP_STRINGS as MAX_STOP
from nanoserve.server.body.parts import Body, Bool, Bounds, Int, Message, Number, documented


class StreamOptions(Body):
    include_usage: Bool | None = None
    continuous_usage_stats: Annotated[Bool | None, documented(
        description="with include_usage: usage on every chunk (vLLM's)")] = None


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
    json_schema: Annotated[JsonSchemaFormat | None, documented(
        description="required with type json_schema")] = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: one of json, regex, choice or grammar."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | StrictStr | None = Field(default=None, alias="json")
    regex: Annotated[StrictStr | None, Field(min_length=1)] = None
    choice: Annotated[list[Annotated[StrictStr, Field(min_length=1)]] | None,
                      Field(min_length=1)] = None
    grammar: Annotated[StrictStr | None, Field(min_length=1)] = None


class FunctionDef(BaseModel):
    """A function the model may call: its name, what it does, its arguments' JSON schema."""

    model_config = ConfigDict(extra="ignore")
    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: StrictStr | None = None
    parameters: Annotated[dict[str, Any] | None, documented(
        description="a JSON schema (checked against Draft 2020-12's metaschema)")] = None
    strict: Bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class ToolName(BaseModel):
    name: StrictStr


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: ToolName


ToolChoice = Annotated[Literal["none", "auto", "required"] | NamedToolChoice, documented(
    description="none | auto (needs --enable-auto-tool-choice) | required | a function; "
                "required and a named function are enforced by the grammar engine")]


_PENALTY = documented(minimum=-MAX_ABS_PENALTY, maximum=MAX_ABS_PENALTY)
# Keys are token ids: pydantic would write a key pattern as patternProperties, which
# leaves other keys open, so this schema is spelled out.
LogitBias = Annotated[dict[StrictStr, Number], WithJsonSchema({
    "type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
    "additionalProperties": {"type": "number", "minimum": -MAX_ABS_LOGIT_BIAS,
                             "maximum": MAX_ABS_LOGIT_BIAS}})]
StopStr = Annotated[StrictStr, documented(minLength=1)]
# A field we know but cannot honour: any value is refused by name (parse.py), which is
# clearer than a 400 on its type, and the document says so. `refused` lists them per model.
Refused = Annotated[None, documented(description="not supported: any value is a 400")]


@functools.cache
def refused(model: type[BaseModel]) -> tuple[str, ...]:
    """The fields of `model` typed Refused, in its order: the one statement of what a
    route refuses (completions refuse `tools` and `tool_choice`, which chat has)."""
    return tuple(name for name, f in model.model_fields.items() if f.annotation is type(None))


def generation_models(served: str, b: Bounds) -> tuple[type[Body], type[Body]]:
    """Completion and Chat, each the shared fields plus its own."""
    TokenId = Annotated[Int, b.token_id()]  # noqa: N806
    TokenIds = Annotated[list[TokenId], Field(min_length=1)]  # noqa: N806
    MaxTokens = Annotated[Int | None, b.max_tokens()]  # noqa: N806
    sampling = _sampling_model(served, TokenId, MaxTokens)
    Text = Annotated[StrictStr, Field(min_length=1)]  # noqa: N806

    # The base is built per served model (its bounds), which mypy cannot follow.
    class Completion(sampling):  # type: ignore[misc,valid-type]
        """A completion; each prompt string is tokenized and must be non-empty."""

        model_config = ConfigDict(title="CompletionRequest")
        prompt: (Text | Annotated[list[Text], Field(min_length=1)] | TokenIds
                 | Annotated[list[TokenIds], Field(min_length=1)])
        echo: Bool | None = None
        logprobs: Annotated[Int | None, documented(minimum=0, maximum=MAX_LOGPROBS)] = None
        best_of: Annotated[Int | None, documented(minimum=1, maximum=MAX_N,
                                                    description="must equal n")] = None

    class Chat(sampling):  # type: ignore[misc,valid-type]
        """A chat completion; messages go through the chat template."""

        model_config = ConfigDict(title="ChatCompletionRequest")
        messages: Annotated[list[Message], Field(min_length=1)]
        add_generation_prompt: Bool | None = None
        max_completion_tokens: MaxTokens = None
        logprobs: Bool | None = None
        top_logprobs: Annotated[Int | None, documented(
            minimum=0, maximum=MAX_LOGPROBS, description="needs logprobs: true")] = None
        tools: list[Tool] | None = None
        tool_choice: ToolChoice | None = None
        parallel_tool_calls: Bool | None = None

    return Completion, Chat


def _sampling_model(served: str, TokenId: Any, MaxTokens: Any) -> type[Body]:  # noqa: N803
    """The fields every generation request shares: those copied into SamplingParams. The
    served model's annotated types come from generation_models, which the chat model's
    own fields share."""

    class Sampling(Body):
        """The fields copied into SamplingParams, with its ranges (nanoserve/sampling/params.py)."""

        model: Annotated[StrictStr | None, documented(enum=[served])] = None
        n: Annotated[Int | None, documented(minimum=1, maximum=MAX_N)] = None
        temperature: Annotated[Number | None,
                               documented(minimum=0, description="0 is greedy")] = None
        top_p: Annotated[Number | None, documented(exclusiveMinimum=0, maximum=1)] = None
        top_k: Annotated[Int | None, documented(minimum=-1, description="0 or -1: off")] = None
        min_p: Annotated[Number | None, documented(minimum=0, maximum=1)] = None
        seed: Annotated[Int | None, documented(minimum=MIN_SEED, maximum=MAX_SEED)] = None
        max_tokens: MaxTokens = None
        min_tokens: Annotated[Int | None, documented(minimum=0,
                                                       description="at most max_tokens")] = None
        ignore_eos: Bool | None = None
        speculate: Annotated[Bool | None, documented(
            description="false: no speculative proposals for this request (the tokens are "
            "the same; only their pace differs)")] = None
        stop_token_ids: list[TokenId] | None = None
        stop: Annotated[StopStr | Annotated[list[StopStr], documented(maxItems=MAX_STOP)] | None,
                        Field(union_mode="left_to_right")] = None
        include_stop_str_in_output: Bool | None = None
        skip_special_tokens: Bool | None = None
        presence_penalty: Annotated[Number | None, _PENALTY] = None
        frequency_penalty: Annotated[Number | None, _PENALTY] = None
        repetition_penalty: Annotated[Number | None, documented(exclusiveMinimum=0)] = None
        logit_bias: Annotated[LogitBias | None, documented(
            description="token id (a decimal string) -> bias")] = None
        stream: Bool | None = None
        stream_options: Annotated[StreamOptions | None,
                                  documented(description="only with stream: true")] = None
        tools: Refused = None
        tool_choice: Refused = None
        functions: Refused = None
        function_call: Refused = None
        suffix: Refused = None
        # vLLM's extras for scoring (lm-evaluation-harness's loglikelihood) and tracing.
        prompt_logprobs: Annotated[Int | None, documented(
            minimum=0, maximum=MAX_LOGPROBS, description="vLLM's: each prompt token's "
            "logprob and this many alternatives (the first token's entry is null)")] = None
        return_token_ids: Annotated[Bool | None, documented(
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
