"""OpenAI's Responses API (`POST /v1/responses`), read as a chat-completions request (issue 29).

The server keeps no responses, so the Responses API is served statelessly: a request is
translated into the chat-completions body a client would have posted, runs through the
chat machinery unchanged, and its output is rendered back in the Responses shape
(events.py). Translation is pure: a Mapping in, a dict out, or an `ApiError` 400
whose `param` names the field in the *Responses* spelling (`input[2].call_id`), since that
is what the client sent.

    input             a string: one user message; a list of items:
                      message (role user|assistant|system|developer; developer -> system)
                      function_call -> an assistant message's tool_calls (merged into the
                      assistant message just before it, so text + calls make one turn)
                      function_call_output -> a tool message (its call must come earlier)
                      reasoning -> dropped (stateless: there is no reasoning to carry)
    instructions      a leading system message
    tools             flat function tools -> chat's nested ones; other tool types: 400
    tool_choice       none|auto|required, {"type": "function", "name"}; others: 400
    max_output_tokens -> max_tokens; temperature, top_p, seed, stream, parallel_tool_calls,
                      model pass through (the chat layer checks their ranges)
    text.format       json_schema -> response_format json_schema, json_object -> json_object,
                      text -> nothing
    refused (400)     previous_response_id, conversation, prompt (stored state we do not
                      keep), background: true
    ignored           store (nothing is stored either way), metadata and user (echoed only),
                      reasoning (the chat template decides), truncation (an overlong prompt
                      is a 400), include (nothing extra to include), service_tier,
                      safety_identifier, prompt_cache_key, stream_options; and, as on the
                      chat route, any field we do not know.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from nanoserve.server.errors import ApiError, bad_request

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text")
_TOOL_CHOICES = ("none", "auto", "required")
# Fields that would need state kept between requests: refused when not null.
_STATEFUL = ("previous_response_id", "conversation", "prompt")
_PASSED = ("model", "temperature", "top_p", "seed", "stream", "parallel_tool_calls")


# The chat fields to_chat_body writes under another name: a 400 from the chat machinery
# names the field as the Responses request spells it (longest chat name first).
_RESPONSES_NAMES = (("response_format.json_schema.schema", "text.format.schema"),
                    ("response_format.json_schema", "text.format"),
                    ("response_format", "text.format"), ("max_tokens", "max_output_tokens"),
                    ("tool_choice.function.name", "tool_choice.name"))


def responses_error(exc: ApiError) -> ApiError:
    """`exc`, a 400 about the chat body to_chat_body made, with its field (in `param` and
    in the message) spelt as the Responses request spells it."""
    for chat, ours in _RESPONSES_NAMES:
        if exc.param is not None and (exc.param == chat or exc.param.startswith(chat + ".")):
            return dataclasses.replace(exc, param=ours + exc.param[len(chat):],
                                       message=exc.message.replace(chat, ours))
    return exc


def to_chat_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat-completions body equivalent to the Responses request `body`."""
    if not isinstance(body, Mapping):
        raise bad_request(None, "the request body must be a JSON object")
    _refuse_state(body)
    tools = _tools(body.get("tools"))
    chat: dict[str, Any] = {k: body[k] for k in _PASSED if body.get(k) is not None}
    chat["messages"] = _instructions(body.get("instructions")) + _input(body.get("input"))
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = _max_output_tokens(body["max_output_tokens"])
    response_format = _text_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    return chat


def request_echo(body: Mapping[str, Any]) -> dict[str, Any]:
    """The request fields a Response object repeats (`openai.types.responses.Response`
    requires tools, tool_choice and parallel_tool_calls). Call after `to_chat_body`
    accepted `body`: the values are echoed as sent, defaults filled in."""
    text = body.get("text") or {}
    return {
        "instructions": body.get("instructions"),
        "tools": [dict(t) for t in body.get("tools") or []],
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"),
        "text": {**text, "format": text.get("format") or {"type": "text"}},
        "metadata": body.get("metadata"),
        "user": body.get("user"),
        "reasoning": body.get("reasoning"),
        "truncation": body.get("truncation") or "disabled",
        "previous_response_id": None,
        "background": False,
    }


def _refuse_state(body: Mapping[str, Any]) -> None:
    for field in _STATEFUL:
        if body.get(field) is not None:
            raise bad_request(field, f"{field} is not supported: this server is stateless "
                              "and keeps no responses; send the whole conversation as `input`")
    if body.get("background") not in (None, False):
        raise bad_request("background", "background: true is not supported: this server "
                          "keeps no responses to poll later")


def _instructions(instructions: Any) -> list[dict[str, Any]]:
    if instructions is None:
        return []
    if not isinstance(instructions, str):
        raise bad_request("instructions", "instructions must be a string")
    return [{"role": "system", "content": instructions}]


def _input(items: Any) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("input", "input must be a string or a non-empty list of items",
                          "missing" if items is None else "invalid_value")
    messages: list[dict[str, Any]] = []
    calls: set[str] = set()  # call ids seen so far: an output must answer one of them
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise bad_request(where, f"{where} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            _add_call(messages, item, where, calls)
        elif kind == "function_call_output":
            messages.append(_call_output(item, where, calls))
        elif kind != "reasoning":
            raise bad_request(f"{where}.type", f"{where}.type {kind!r} is not supported "
                              "(message, function_call, function_call_output, reasoning)")
    return messages


def _message(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise bad_request(f"{where}.role", f"{where}.role must be one of {', '.join(_ROLES)}")
    return {"role": _ROLES[role], "content": _content(item.get("content"), f"{where}.content")}


def _content(content: Any, where: str) -> str:
    """A message's text: a string, or its text parts joined (as the chat route joins them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(where, f"{where} must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in _TEXT_PARTS:
            raise bad_request(f"{where}[{j}].type", f"{where}[{j}].type {kind!r} is not "
                              "supported (input_text, output_text)")
        texts.append(_string(part, "text", f"{where}[{j}]"))
    return "".join(texts)


def _add_call(messages: list[dict[str, Any]], item: Mapping[str, Any], where: str,
              calls: set[str]) -> None:
    """A function_call joins the assistant message just before it (its text, or the calls
    before it): one Responses turn is [message?, function_call...], one chat turn."""
    call_id = _string(item, "call_id", where)
    calls.add(call_id)
    call = {"id": call_id, "type": "function",
            "function": {"name": _string(item, "name", where),
                         "arguments": _string(item, "arguments", where)}}
    last = messages[-1] if messages else None
    if last is None or last["role"] != "assistant":
        last = {"role": "assistant", "content": None}
        messages.append(last)
    last.setdefault("tool_calls", []).append(call)


def _call_output(item: Mapping[str, Any], where: str, calls: set[str]) -> dict[str, Any]:
    call_id = _string(item, "call_id", where)
    if call_id not in calls:
        raise bad_request(f"{where}.call_id", f"{where}.call_id {call_id!r} answers no "
                          "earlier function_call item (the server is stateless: send the "
                          "function_call items too)")
    output = item.get("output")
    if isinstance(output, list):
        output = _content(output, f"{where}.output")
    elif not isinstance(output, str):
        raise bad_request(f"{where}.output", f"{where}.output must be a string",
                          "missing" if output is None else "invalid_value")
    return {"role": "tool", "tool_call_id": call_id, "content": output}


def _string(item: Mapping[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key}", f"{where}.{key} must be a string",
                          "missing" if value is None else "invalid_value")
    return value


def _tools(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad_request("tools", "tools must be a list")
    return [_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]


def _tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, Mapping):
        raise bad_request(where, f"{where} must be an object")
    if tool.get("type") != "function":
        raise bad_request(f"{where}.type", f"{where}.type {tool.get('type')!r} is not "
                          "supported: only function tools are (no hosted tools)")
    function: dict[str, Any] = {"name": _string(tool, "name", where)}
    if tool.get("description") is not None:
        function["description"] = _string(tool, "description", where)
    parameters = tool.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, Mapping):
            raise bad_request(f"{where}.parameters", f"{where}.parameters must be a JSON "
                              "Schema object")
        function["parameters"] = dict(parameters)
    if tool.get("strict") is not None:
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    if choice in _TOOL_CHOICES:
        return choice
    if not isinstance(choice, Mapping) or choice.get("type") != "function":
        raise bad_request("tool_choice", "tool_choice must be none, auto, required or "
                          '{"type": "function", "name": ...}')
    # Whether the name is among the tools is the chat plan's check (tools/plan.py).
    return {"type": "function", "function": {"name": _string(choice, "name", "tool_choice")}}


def _max_output_tokens(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad_request("max_output_tokens", "max_output_tokens must be an integer >= 1")
    return value


def _text_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, Mapping):
        raise bad_request("text", "text must be an object")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise bad_request("text.format.type", "text.format.type must be text, json_object "
                          "or json_schema")
    schema = fmt.get("schema")
    if not isinstance(schema, Mapping):
        raise bad_request("text.format.schema", "text.format.schema must be a JSON Schema "
                          "object", "missing" if schema is None else "invalid_value")
    spec: dict[str, Any] = {"name": _string(fmt, "name", "text.format"), "schema": dict(schema)}
    for key in ("description", "strict"):
        if fmt.get(key) is not None:
            spec[key] = fmt[key]
    return {"type": "json_schema", "json_schema": spec}
