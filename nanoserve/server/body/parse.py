"""Request bodies in, typed requests out: the OpenAI (and vLLM) fields we honour.

Types and shapes are checked by the request models (server/body/protocol.py, which `/openapi.json`
is generated from); values by `SamplingParams`, whose checks raise `ParamError` naming the
field; what depends on several fields (best_of and n, stream_options without stream, ...)
here. Either way a bad body is a 400 whose `param` names the field, before anything reaches
the engine. Fields we do not know are ignored (clients send vendor extras); fields we know
but cannot honour (the legacy functions, ...) are refused rather than silently dropped,
because ignoring them would hand back an answer of a different shape than the client asked
for.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from nanoserve.sampling.grammar import GuidedSpec
from nanoserve.sampling.params import ParamError, SamplingParams
from nanoserve.server.body.constraints import request_constraint
from nanoserve.server.body.generation_models import refused
from nanoserve.server.body.limits import (
    Caps,
    check_prompt_chars,
    check_template_chars,
    check_tools,
    message_chars,
)
from nanoserve.server.body.nesting import MAX_DEPTH, deep_field, too_deep
from nanoserve.server.body.parts import Message
from nanoserve.server.body.protocol import Protocol, validate
from nanoserve.server.errors import ApiError, bad_request, from_param_error
from nanoserve.server.settings import AgentSettings
from nanoserve.server.tools.output import OutputPlan
from nanoserve.server.tools.plan import plan_tools
from nanoserve.tokenizer import Tokenizer

Prompt = str | list[int]

# Copied as-is into SamplingParams when present and not null; it validates them.
_SAMPLING_FIELDS = (
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "min_tokens", "ignore_eos",
    "stop_token_ids", "stop", "include_stop_str_in_output", "skip_special_tokens",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
    "prompt_logprobs", "speculate",
)  # fmt: skip
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI completions API's default
NO_AGENTS = AgentSettings()  # no tool-call or reasoning parser, auto tool choice off


@dataclass(frozen=True, slots=True)
class StreamUsage:
    """`stream_options`: a usage chunk at the end (`include_usage`), and, as vLLM sends it
    with `continuous_usage_stats` as well, usage so far on every chunk (GuideLLM asks)."""

    at_end: bool = False
    every_chunk: bool = False


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """What both generation endpoints reduce to."""

    prompts: tuple[Prompt, ...]
    params: SamplingParams
    stream: bool
    usage: StreamUsage
    echo: bool = False
    # vLLM's: answer with the prompt's logprobs (when asked by name, not merely implied by
    # echo with logprobs), and with the prompt's and the completions' token ids.
    prompt_logprobs: bool = False
    return_token_ids: bool = False
    output: OutputPlan | None = None  # chat: reasoning and tool calls read out of the text


def loads(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400. NaN and Infinity are not JSON; Python's parser
    accepts them unless told not to."""

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    if too_deep(raw):  # before the parser, which would recurse all the way down
        field = deep_field(raw)
        raise bad_request(field, f"{field or 'request body'}: nests deeper than {MAX_DEPTH} "
                          "levels of arrays and objects", "too_deep")
    try:
        body = json.loads(raw, parse_constant=no_constants)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise bad_request(None, f"request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(None, f"request body must be a JSON object, got {type(body).__name__}",
                          "invalid_json")
    # Only an escape can smuggle one in (raw bytes must be UTF-8), so most bodies skip the walk.
    if _SURROGATE_ESCAPE.search(raw):
        _refuse_lone_surrogates(body)
    return body


# `\uD800`-`\uDFFF`: a half of a UTF-16 pair; a whole pair decodes to one code point.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _refuse_lone_surrogates(body: dict[str, Any]) -> None:
    """JSON may spell a lone UTF-16 surrogate (`"\\ud800"`), but it is no Unicode character:
    the tokenizer cannot encode it and a response cannot carry it, so it is a 400 here rather
    than a 500 later. Iterative, so a deeply nested body cannot exhaust the stack."""
    for key, value in body.items():
        stack: list[Any] = [key, value]
        while stack:
            item = stack.pop()
            if isinstance(item, str):
                if _SURROGATE.search(item):
                    param = None if _SURROGATE.search(key) else key  # a field name we can echo
                    raise bad_request(param, f"{key!r:.40} holds a lone UTF-16 surrogate, "
                                      "which is not a Unicode character", "invalid_json")
            elif isinstance(item, dict):
                stack.extend(item.keys())
                stack.extend(item.values())
            elif isinstance(item, list):
                stack.extend(item)


def check_model(body: Mapping[str, Any], served: str, *, required: bool = False) -> None:
    model = body.get("model")
    if model is None and not required:
        return  # vLLM's convention: no model means the one we serve
    if not isinstance(model, str):
        raise bad_request("model", f"model must be a string, got {model!r}")
    if model != served:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                       f"{served!r}", "model", "model_not_found")


def _checked(body: Mapping[str, Any], model: type[BaseModel], served: str) -> Any:
    """The body as `model`, after the checks whose answer is more than a 400 on a type:
    a model we do not serve (404) and the fields the model marks Refused (named as
    unsupported: the legacy function calling, and tools on completions)."""
    check_model(body, served)
    for name in refused(model):
        if body.get(name) is not None:
            raise bad_request(name, f"{name} is not supported by this server", "unsupported")
    return validate(model, body)


def completion(body: Mapping[str, Any], api: Protocol, caps: Caps | None = None
               ) -> GenerateRequest:
    """`caps`: the size limits (limits.py); None checks none (an offline workload)."""
    req = _checked(body, api.completion, api.served)
    prompt = req.prompt
    prompts: tuple[Prompt, ...] = (
        (prompt,) if isinstance(prompt, str)
        else (prompt,) if isinstance(prompt[0], int)
        else tuple(prompt))
    for i, p in enumerate(prompts):  # each is tokenized on its own, and must fit alone
        if isinstance(p, str):
            check_prompt_chars("prompt" if isinstance(prompt, str) else f"prompt[{i}]",
                               len(p), caps)
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise bad_request("best_of", "best_of other than n is not supported")
    fields = _sampling_fields(req, request_constraint(req))
    # Absent: the OpenAI default; null: whatever the context leaves.
    fields["max_tokens"] = (req.max_tokens if "max_tokens" in req.model_fields_set
                            else COMPLETIONS_DEFAULT_MAX_TOKENS)
    echo = bool(req.echo)
    if req.logprobs is not None:
        fields["logprobs"] = req.logprobs
        # The echoed prompt comes with its own logprobs, as in OpenAI's and vLLM's; as in
        # vLLM's, an explicit prompt_logprobs sets how many alternatives they are scored with.
        if echo and "prompt_logprobs" not in fields:
            fields["prompt_logprobs"] = req.logprobs
    return GenerateRequest(prompts, _params(fields), *_stream(req), echo, *_returns(req))


def chat(
    body: Mapping[str, Any], api: Protocol, tokenizer: Tokenizer, template: str | None,
    now: Callable[[], float] = time.time, agents: AgentSettings = NO_AGENTS,
    caps: Caps | None = None,
) -> GenerateRequest:
    """`caps`: the size limits (limits.py), each checked before the work it bounds."""
    check_tools(body, caps)
    req = _checked(body, api.chat, api.served)
    require_template(tokenizer, template)
    _check_tool_messages(req.messages)
    check_prompt_chars("messages", message_chars(req.messages), caps)
    source = template or tokenizer.chat_template or ""
    plan = plan_tools(req, request_constraint(req), agents, source,
                      tokenizer.template_reads("tools", template))
    text = chat_text(req.messages, req.add_generation_prompt, tokenizer, template, now,
                     plan.tools)
    check_template_chars(text, caps)
    fields = _sampling_fields(req, plan.constraint)
    # max_completion_tokens replaced max_tokens in the chat API; the newer one wins.
    if req.max_completion_tokens is not None:
        fields["max_tokens"] = req.max_completion_tokens
    elif req.max_tokens is not None:
        fields["max_tokens"] = req.max_tokens
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs", "top_logprobs needs logprobs set to true")
    if req.logprobs:
        fields["logprobs"] = 0 if req.top_logprobs is None else req.top_logprobs
    stream = _stream(req)
    try:
        params = SamplingParams(**fields)
    except ParamError as exc:
        if exc.field == "logprobs":  # the chat API's name for the count
            raise bad_request("top_logprobs", exc.message.replace("logprobs", "top_logprobs",
                                                                  1)) from None
        raise from_param_error(exc) from None
    # As ids: the template wrote the special tokens it wants (a text prompt gets the
    # tokenizer's own, Tokenizer.encode_prompt)
    return GenerateRequest((tokenizer.encode(text),), params, *stream, False, *_returns(req),
                           output=plan.output)


def require_template(tokenizer: Tokenizer, template: str | None) -> None:
    """A 400 for messages where there is no chat template; each route that renders them
    asks once, before its other checks (chat, /tokenize)."""
    if template is None and tokenizer.chat_template is None:  # a base model (vLLM's 400 too)
        raise bad_request("messages", "this model has no chat template (a base model): use "
                                      "/v1/completions, or start the server with "
                                      "--chat-template")


def _check_tool_messages(messages: Sequence[Message]) -> None:
    """A tool result must say which call it answers (the template pairs them by id)."""
    for i, m in enumerate(messages):
        if m.role == "tool" and not m.tool_call_id:
            raise bad_request(f"messages[{i}].tool_call_id", f"messages[{i}] has role tool "
                              "but no tool_call_id: it must name the call it answers",
                              "missing")


def chat_text(messages: Sequence[Message], add_generation_prompt: bool | None,
              tokenizer: Tokenizer, template: str | None,
              now: Callable[[], float] = time.time,
              tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """`messages` rendered through the chat template (the server's, else the model's);
    `now` is the clock a template's `strftime_now` reads (the app's injected one). The
    caller has asked `require_template`."""
    try:
        return tokenizer.apply_chat_template(
            [m.as_dict() for m in messages],
            add_generation_prompt=True if add_generation_prompt is None
            else add_generation_prompt,
            chat_template=template, now=now, tools=tools,
        )
    except Exception as exc:  # jinja's TemplateError, or a template that raises on roles
        raise bad_request("messages", f"the chat template rejected the messages: {exc}") from None


def _returns(req: Any) -> tuple[bool, bool]:
    """What the answer carries beyond the OpenAI shape: prompt_logprobs, token ids."""
    return req.prompt_logprobs is not None, bool(req.return_token_ids)


def _stream(req: Any) -> tuple[bool, StreamUsage]:
    stream = bool(req.stream)
    opts = req.stream_options
    if opts is None:
        return stream, StreamUsage()
    if not stream:
        raise bad_request("stream_options", "stream_options is only allowed when stream is true")
    at_end = bool(opts.include_usage)
    # As vLLM: continuous_usage_stats adds to include_usage and means nothing without it.
    return stream, StreamUsage(at_end, at_end and bool(opts.continuous_usage_stats))


def _sampling_fields(req: Any, guided: GuidedSpec | None) -> dict[str, Any]:
    """The fields SamplingParams takes, and the request's one constraint (a completion's
    from its format fields; a chat's from its tool plan, which composes the two)."""
    out = {k: v for k in _SAMPLING_FIELDS if (v := getattr(req, k)) is not None}
    if "stop_token_ids" in out:
        out["stop_token_ids"] = tuple(out["stop_token_ids"])
    if guided is not None:
        out["guided"] = guided
    return out


def _params(fields: dict[str, Any]) -> SamplingParams:
    try:
        return SamplingParams(**fields)
    except ParamError as exc:
        raise from_param_error(exc) from None
