"""Request bodies in, typed requests out: the OpenAI (and vLLM) fields we honour.

Parsing is separate from validation of values: this module checks shapes and types of the
HTTP-level fields (prompt, messages, stream, echo, ...) and copies the sampling fields into
`SamplingParams`, whose own checks raise `ParamError` naming the field. Either way a bad
body is a 400 whose `param` names the field, before anything reaches the engine. Fields we
do not know are ignored (clients send vendor extras); fields we know but cannot honour
(tools, response_format, ...) are refused rather than silently dropped, because ignoring
them would hand back an answer of a different shape than the client asked for.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nanoserve.sampling import ParamError, SamplingParams
from nanoserve.server.errors import ApiError, bad_request, from_param_error
from nanoserve.tokenizer import Tokenizer

Prompt = str | list[int]

# Copied as-is into SamplingParams when present and not null; it validates them.
_SAMPLING_FIELDS = (
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "min_tokens", "ignore_eos",
    "stop_token_ids", "stop", "include_stop_str_in_output", "skip_special_tokens",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
)  # fmt: skip
_REFUSED = ("tools", "tool_choice", "functions", "function_call", "suffix", "prompt_logprobs")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI completions API's default


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """What both generation endpoints reduce to."""

    prompts: tuple[Prompt, ...]
    params: SamplingParams
    stream: bool
    usage: StreamUsage
    echo: bool = False


@dataclass(frozen=True, slots=True)
class StreamUsage:
    """`stream_options`: a usage chunk at the end (`include_usage`), and, as vLLM sends it
    with `continuous_usage_stats` as well, usage so far on every chunk (GuideLLM asks)."""

    at_end: bool = False
    every_chunk: bool = False


def loads(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400. NaN and Infinity are not JSON; Python's parser
    accepts them unless told not to."""

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

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


def completion(body: Mapping[str, Any], served: str) -> GenerateRequest:
    check_model(body, served)
    _refuse(body, _REFUSED)
    prompts = _prompts(body.get("prompt"))
    echo = opt_bool(body, "echo", False)
    logprobs = body.get("logprobs")
    best_of = body.get("best_of")
    if best_of is not None and best_of != (body.get("n") or 1):
        raise bad_request("best_of", "best_of other than n is not supported")
    fields = _sampling_fields(body)
    fields["max_tokens"] = body.get("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
    if logprobs is not None:
        fields["logprobs"] = logprobs
        if echo:  # the echoed prompt comes with its own logprobs, as in OpenAI's and vLLM's
            fields["prompt_logprobs"] = logprobs
    stream, usage = _stream(body)
    return GenerateRequest(prompts, _params(fields), stream, usage, echo)


def chat(
    body: Mapping[str, Any], served: str, tokenizer: Tokenizer, template: str | None
) -> GenerateRequest:
    check_model(body, served)
    _refuse(body, _REFUSED)
    fmt = body.get("response_format")
    # {"type": "text"} is the default behaviour, spelled out; anything else changes the shape.
    if fmt is not None and fmt != {"type": "text"}:
        raise bad_request("response_format", "response_format is not supported", "unsupported")
    text = chat_text(body, tokenizer, template)
    fields = _sampling_fields(body)
    # max_completion_tokens replaced max_tokens in the chat API; the newer one wins.
    mct = body.get("max_completion_tokens")
    if mct is not None:
        fields["max_tokens"] = mct
    elif body.get("max_tokens") is not None:
        fields["max_tokens"] = body["max_tokens"]
    want = opt_bool(body, "logprobs", False)
    top = body.get("top_logprobs")
    if top is not None and not want:
        raise bad_request("top_logprobs", "top_logprobs needs logprobs set to true")
    if want:
        fields["logprobs"] = 0 if top is None else top
    stream, usage = _stream(body)
    try:
        params = SamplingParams(**fields)
    except ParamError as exc:
        if exc.field == "logprobs":  # the chat API's name for the count
            raise bad_request("top_logprobs", exc.message.replace("logprobs", "top_logprobs",
                                                                  1)) from None
        raise from_param_error(exc) from None
    return GenerateRequest((text,), params, stream, usage)


def chat_text(body: Mapping[str, Any], tokenizer: Tokenizer, template: str | None) -> str:
    """`messages` rendered through the chat template (the server's, else the model's)."""
    messages = _messages(body.get("messages"))
    add_gen = opt_bool(body, "add_generation_prompt", True)
    try:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_gen, chat_template=template
        )
    except Exception as exc:  # jinja's TemplateError, or a template that raises on roles
        raise bad_request("messages", f"the chat template rejected the messages: {exc}") from None


def token_list(value: object, name: str) -> list[int]:
    if not isinstance(value, list) or not value:
        raise bad_request(name, f"{name} must be a non-empty list of token ids, got {value!r}")
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise bad_request(name, f"{name} must hold token ids (integers >= 0), got {v!r}")
    return value


def _prompts(value: object) -> tuple[Prompt, ...]:
    shape = "a string, a list of strings, a list of token ids, or a list of such lists"
    if value is None:
        raise bad_request("prompt", "prompt is required", "missing")
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not value:
        raise bad_request("prompt", f"prompt must be {shape}, non-empty; got {value!r:.80}")
    if all(isinstance(v, str) for v in value):
        return tuple(value)
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return (token_list(value, "prompt"),)
    if all(isinstance(v, list) for v in value):
        return tuple(token_list(v, "prompt") for v in value)
    raise bad_request("prompt", f"prompt must be {shape}; got a list of mixed types")


def _messages(value: object) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise bad_request("messages", f"messages must be a non-empty list, got {value!r:.80}")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request("messages", f"{where} must be an object with a string role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise bad_request("messages", f"{where}: only text content parts are "
                                      "supported", "unsupported")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is not None and not isinstance(content, str):
            raise bad_request("messages", f"{where}.content must be a string, a list of text "
                              f"parts, or null; got {content!r:.80}")
        out.append({**m, "content": content if content is not None else ""})
    return out


def _stream(body: Mapping[str, Any]) -> tuple[bool, StreamUsage]:
    stream = opt_bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is None:
        return stream, StreamUsage()
    if not stream:
        raise bad_request("stream_options", "stream_options is only allowed when stream is true")
    if not isinstance(opts, dict):
        raise bad_request("stream_options", f"stream_options must be an object, got {opts!r}")
    flags = []
    for name in ("include_usage", "continuous_usage_stats"):
        value = opts.get(name)
        if value is not None and not isinstance(value, bool):
            raise bad_request("stream_options", f"stream_options.{name} must be true or false, "
                              f"got {value!r}")
        flags.append(bool(value))
    at_end, continuous = flags
    # As vLLM: continuous_usage_stats adds to include_usage and means nothing without it.
    return stream, StreamUsage(at_end, at_end and continuous)


def _sampling_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: body[k] for k in _SAMPLING_FIELDS if body.get(k) is not None}
    stop_ids = out.get("stop_token_ids")
    if isinstance(stop_ids, list):
        out["stop_token_ids"] = tuple(stop_ids)
    return out


def _params(fields: dict[str, Any]) -> SamplingParams:
    try:
        return SamplingParams(**fields)
    except ParamError as exc:
        raise from_param_error(exc) from None


def opt_bool(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(name, f"{name} must be true or false, got {value!r}")
    return value


def _refuse(body: Mapping[str, Any], names: Sequence[str]) -> None:
    for name in names:
        if body.get(name) is not None:
            raise bad_request(name, f"{name} is not supported by this server", "unsupported")
