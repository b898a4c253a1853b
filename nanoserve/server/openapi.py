"""`GET /openapi.json`: an OpenAPI 3.1 document of exactly the routes the app registers.

The request schemas are generated from the request models that parse validates with
(server/body/protocol.py), their ranges from the same limits `SamplingParams` checks
(`sampling.MAX_N`, `MAX_LOGPROBS`, ...), so they cannot drift silently; tests/test_openapi.py
checks that the paths and methods equal the app's URL map and that the schemas agree with
the validators at every boundary. What a schema cannot say (a prompt plus max_tokens that
overflows max_model_len or the KV pool, min_tokens above max_tokens, a chat template that
refuses a role) is a 400 too, named in `description`s. Fields the server refuses (tools,
suffix, ...) are typed `null`: absent or null is fine, any value is a 400. Unknown fields
are ignored, hence `additionalProperties` is left open.

The route needs the API key like every route but `/health`: the document maps the surface
an attacker would probe, and a client that may call the API may read it. The bearer scheme
appears only when the server has a key. HEAD and OPTIONS, which Quart adds to every route
on its own, are left out; the fuzz tests check that they answer without a 5xx.
"""

from __future__ import annotations

import copy
from typing import Any

from quart import Quart, Response

from nanoserve.server.body import protocol
from nanoserve.server.respond import json_response
from nanoserve.server.settings import ServerConfig
from nanoserve.server.state import current_state

Schema = dict[str, Any]
ERROR_REF = {"$ref": "#/components/schemas/Error"}


def request_schemas(model: str, vocab: int | None, max_len: int | None) -> dict[str, Schema]:
    """The JSON body of each POST route, by path: generated from the request models."""
    return protocol.request_schemas(model, vocab, max_len)


def _obj(props: dict[str, Schema], **kw: Any) -> Schema:
    return {"type": "object", "properties": props, "required": sorted(props), **kw}


_NUM = {"type": "integer"}
_STR = {"type": "string"}
_USAGE = _obj({"prompt_tokens": _NUM, "completion_tokens": _NUM, "total_tokens": _NUM})
_FINISH = {"finish_reason": {"type": ["string", "null"]},
           "stop_reason": {"type": ["string", "integer", "null"]}}


_IDS = {"type": "array", "items": _NUM}
# vLLM's prompt_logprobs: null for the first prompt token, then token id -> its logprob
# (null as a whole when the request ended before its first token).
_LOGPROB = _obj({"logprob": {"type": "number"}, "rank": _NUM, "decoded_token": _STR})
_PROMPT_LOGPROBS = {"type": ["array", "null"],
                    "items": {"type": ["object", "null"], "additionalProperties": _LOGPROB}}
# Present only when asked for (prompt_logprobs, return_token_ids): chat puts the prompt's
# on the response, completions on each choice.
_PROMPT_EXTRAS = {"prompt_logprobs": _PROMPT_LOGPROBS, "prompt_token_ids": _IDS}


# A chat message's fields beyond role and content, present where they apply.
_CALL = _obj({"id": _STR, "type": {"const": "function"}, "function": _obj(
    {"name": _STR, "arguments": {"type": "string", "description": "a JSON object's text"}})})
_MESSAGE_EXTRAS = {"tool_calls": {"type": "array", "items": _CALL},
                   "reasoning_content": {"type": ["string", "null"]}}
# /v1/responses: what server/responses/translate.py reads (it names a bad field in its 400);
# the stateful fields are typed null (the server keeps no responses).
_ITEMS = {"type": "array", "items": {"type": "object"}}
_RESPONSES_BODY: Schema = {"type": "object", "required": ["input"], "properties": {
    "model": _STR, "input": {"type": ["string", "array"], "items": {"type": "object"}},
    "instructions": {"type": ["string", "null"]}, "tools": _ITEMS,
    "tool_choice": {"type": ["string", "object"]},
    "parallel_tool_calls": {"type": "boolean"},
    "max_output_tokens": {"type": ["integer", "null"], "minimum": 1},
    "temperature": {"type": ["number", "null"], "minimum": 0},
    "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
    "text": {"type": "object"}, "stream": {"type": "boolean"},
    "previous_response_id": {"type": "null", "description": "stateless: any value is a 400"},
}}
_RESPONSE = _obj({"id": _STR, "object": {"const": "response"}, "created_at": _NUM,
                  "status": _STR, "model": _STR, "output": _ITEMS})


def _generation(kind: str, choice: dict[str, Schema]) -> Schema:
    chat = kind == "chat.completion"
    extra_choice = {"token_ids": _IDS, **({} if chat else _PROMPT_EXTRAS)}
    out = _obj({"id": _STR, "object": {"const": kind}, "created": _NUM, "model": _STR,
                "usage": _USAGE, "choices": {"type": "array", "items": _obj(
                    {"index": _NUM, "logprobs": {"type": ["object", "null"]},
                     **_FINISH, **choice})}})
    out["properties"]["choices"]["items"]["properties"].update(extra_choice)
    if chat:
        out["properties"].update(_PROMPT_EXTRAS)
    return out


def _ok(schema: Schema, *, sse: bool = False, media: str = "application/json") -> Schema:
    content = {media: {"schema": schema}}
    if sse:
        # No type: OpenAPI 3.1 reads this schema as the whole body (a string), 3.2 and
        # schemathesis as each event ({"data": ...}); the frames are described in words.
        content["text/event-stream"] = {"schema": {
            "description": "`data: {chunk}` frames, then `data: [DONE]`"}}
    return {"description": "OK", "content": content}


_WHY = {400: "invalid request (param names the field)", 401: "missing or wrong API key",
        404: "unknown model", 408: "the body did not arrive in time",
        413: "the body is over the size limit", 429: "the queue is full (see Retry-After)",
        503: "loading, shutting down, or the engine has failed"}


def _operation(summary: str, ok: Schema, errors: tuple[int, ...], body: Schema | None,
               *, public: bool = False, auth: bool) -> Schema:
    codes = errors + (() if public or not auth else (401,))
    op: Schema = {"summary": summary, "responses": {"200": ok, **{
        str(c): {"description": _WHY[c], "content": {"application/json": {"schema": ERROR_REF}}}
        for c in sorted(codes)}}}
    if 429 in codes:  # the generation routes: a queue limit, and a client may name its request
        op["responses"]["429"]["headers"] = {"Retry-After": {"required": True, "schema": _STR}}
        op["parameters"] = [{"name": "X-Request-Id", "in": "header", "required": False,
                             "schema": {"type": "string", "pattern": "^[!-~]{1,128}$"}}]
    if body is not None:
        op["requestBody"] = {"required": True,
                             "content": {"application/json": {"schema": body}}}
    if public and auth:
        op["security"] = []
    return op


def _paths(body: dict[str, Schema], *, auth: bool) -> Schema:
    """Every route's operation: its request `body` (by path) and its answers."""
    gen = (400, 404, 408, 413, 429, 503)
    aux = (400, 404, 408, 413, 503)
    completion = _generation("text_completion", {"text": _STR})
    message = _obj({"role": {"const": "assistant"}, "content": {"type": ["string", "null"]}})
    message["properties"].update(_MESSAGE_EXTRAS)
    chat = _generation("chat.completion", {"message": message})
    card = _obj({"id": _STR, "object": {"const": "model"}, "created": _NUM,
                 "owned_by": _STR, "root": _STR, "parent": {"type": "null"},
                 "max_model_len": {"type": ["integer", "null"]}})
    tok_info = {**_obj({"tokenizer_class": _STR}), "properties": {
        "tokenizer_class": _STR, "chat_template": _STR, "model_max_length": {"type": "number"}},
        "description": "tokenizer_config.json's entries (added tokens as their text)"}
    tok_out = _obj({"count": _NUM, "max_model_len": _NUM,
                    "tokens": {"type": "array", "items": _NUM},
                    "token_strs": {"type": ["array", "null"], "items": _STR}})

    def op(*args: Any, **kw: Any) -> Schema:
        return _operation(*args, auth=auth, **kw)

    return {
        "/v1/completions": {"post": op("Complete prompts", _ok(completion, sse=True), gen,
                                       body["/v1/completions"])},
        "/v1/chat/completions": {"post": op("Chat", _ok(chat, sse=True), gen,
                                            body["/v1/chat/completions"])},
        "/v1/responses": {"post": op("OpenAI's Responses API, stateless", _ok(
            _RESPONSE, sse=True), gen, _RESPONSES_BODY)},
        "/health": {"get": op("Liveness: 503 while loading, draining or dead",
                              _ok(_obj({"status": {"const": "ok"}})), (503,), None,
                              public=True)},
        "/v1/models": {"get": op("The served model", _ok(_obj(
            {"object": {"const": "list"}, "data": {"type": "array", "items": card}})), (),
            None)},
        "/server_info": {"get": op("The served model's name (what SGLang's router reads)",
                                   _ok(_obj({"served_model_name": _STR})), (), None)},
        "/metrics": {"get": op("Prometheus text exposition 0.0.4", _ok(_STR, media=
                               "text/plain"), (), None)},
        "/tokenize": {"post": op("Text or chat messages to token ids", _ok(tok_out), aux,
                                 body["/tokenize"])},
        "/detokenize": {"post": op("Token ids to text", _ok(_obj({"prompt": _STR})), aux,
                                   body["/detokenize"])},
        "/tokenizer_info": {"get": op("The tokenizer's config and chat template (vLLM's)",
                                      _ok(tok_info), (503,), None)},
        "/openapi.json": {"get": op("This document", _ok({"type": "object"}), (), None)},
    }


def document(config: ServerConfig, *, vocab_size: int | None = None,
             max_model_len: int | None = None) -> Schema:
    """The whole document; the token-id and max_tokens bounds appear once a model is loaded."""
    auth = config.api_key is not None
    body = request_schemas(config.served_model_name, vocab_size, max_model_len)
    doc: Schema = {
        "openapi": "3.1.0",
        "info": {"title": "nanoserve", "version": "0.1.0",
                 "description": "OpenAI-compatible completions and chat (with vLLM's "
                 "extensions). Every non-2xx answer is the OpenAI error object. Integers "
                 "are JSON integers: 2, not 2.0 (JSON Schema counts 2.0 as an integer; "
                 "the validators refuse it, as they refuse true for 1)."},
        "paths": _paths(body, auth=auth),
        "components": {"schemas": {"Error": _obj({"error": _obj({
            "message": _STR, "type": _STR, "param": {"type": ["string", "null"]},
            "code": {"type": ["string", "null"]}}, additionalProperties=False)},
            additionalProperties=False)}},
    }
    if auth:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return copy.deepcopy(doc)  # the module's shared pieces must not be edited through it


def register(app: Quart) -> None:
    @app.get("/openapi.json")
    async def openapi_json() -> Response:
        st = current_state()
        eng = st.ready.engine if st.ready is not None else None
        return json_response(document(
            st.config, vocab_size=eng.model.config.vocab_size if eng else None,
            max_model_len=eng.max_model_len if eng else None))
