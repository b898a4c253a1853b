"""`/openapi.json` is honest: its paths and methods are exactly the app's URL map, it is a
well-formed OpenAPI 3.1 document whose schemas are valid JSON Schema 2020-12, it needs the
API key, and its request schemas agree with the server's own validators at every boundary
(a body the schema accepts gets a 200, one it refuses gets a 400, but for the lax spellings
vLLM also reads, which the document leaves out: it states the canonical types), while every
answer fits the response schema documented for its status."""

from __future__ import annotations

import json
from typing import Any

import jsonschema_rs
from support.http_harness import serving, stub_parts
from support.server_harness import make_app

from nanoserve.sampling.params import MAX_LOGPROBS, MAX_N, MAX_SEED, MAX_STOP_STRINGS, MIN_SEED
from nanoserve.server.openapi import document

AUTOMATIC = {"HEAD", "OPTIONS"}  # Quart adds these to every route; not documented
METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}
SECRET = "sk-openapi-test"
AUTH = {"authorization": f"Bearer {SECRET}"}


async def served_document(**cfg: Any) -> tuple[Any, dict[str, Any]]:
    app = make_app(**cfg)
    headers = AUTH if cfg.get("api_key") else {}
    async with serving(app) as h:
        r = await h.request("GET", "/openapi.json", headers=headers)
        assert r.status == 200, r.body
        assert r.headers["content-type"] == "application/json"
        return app, r.json()


def validator(doc: dict[str, Any], schema: dict[str, Any]) -> Any:
    """A validator for one schema of the document; `#/components/...` refs resolve against
    the document's components, carried along at the root."""
    return jsonschema_rs.Draft202012Validator({**schema, "components": doc["components"]})


async def test_document_lists_exactly_the_app_routes() -> None:
    app, doc = await served_document(api_key=SECRET)
    routes = {(rule.rule, m.lower()) for rule in app.url_map.iter_rules()
              for m in rule.methods - AUTOMATIC}
    documented = {(path, m) for path, item in doc["paths"].items() for m in item}
    assert documented == routes
    assert ("/openapi.json", "get") in routes
    assert ("/health", "get") in routes


def refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "$ref"] + [
            r for v in node.values() for r in refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in refs(v)]
    return []


async def test_document_is_well_formed_openapi_3_1() -> None:
    _, doc = await served_document(api_key=SECRET)
    assert doc["openapi"] == "3.1.0"
    assert doc["info"]["title"]
    assert doc["info"]["version"]
    assert set(doc) <= {"openapi", "info", "paths", "components", "security"}
    for ref in refs(doc):  # every reference points into this document, at something
        assert ref.startswith("#/"), ref
        node: Any = doc
        for part in ref[2:].split("/"):
            node = node[part]
        assert isinstance(node, dict)
    schemas: list[Any] = list(doc["components"]["schemas"].values())
    for path, item in doc["paths"].items():
        assert path.startswith("/"), path
        assert set(item) <= METHODS, path
        for op in item.values():
            assert op["summary"]
            assert op["responses"]
            for code, resp in op["responses"].items():
                assert code.isdigit()
                assert len(code) == 3
                assert resp["description"]
                schemas += [c["schema"] for c in resp["content"].values()]
                schemas += [hd["schema"] for hd in resp.get("headers", {}).values()]
            if "requestBody" in op:
                schemas += [c["schema"] for c in op["requestBody"]["content"].values()]
            schemas += [p["schema"] for p in op.get("parameters", [])]
            for p in op.get("parameters", []):
                assert p["in"] in {"query", "header", "path", "cookie"}
                assert p["name"]
            for sec in op.get("security", doc.get("security", [])):
                assert set(sec) <= set(doc["components"].get("securitySchemes", {}))
    assert len(schemas) > 20
    for schema in schemas:
        assert jsonschema_rs.meta.is_valid(schema), schema
        validator(doc, schema)  # compiles, refs resolve
    json.dumps(doc, allow_nan=False)  # plain JSON: no NaN or Infinity bounds


async def test_document_needs_the_key_and_marks_health_public() -> None:
    async with serving(make_app(api_key=SECRET)) as h:
        r = await h.request("GET", "/openapi.json")
        assert r.status == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    _, doc = await served_document(api_key=SECRET)
    assert doc["security"] == [{"bearer": []}]
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    public = [p for p, item in doc["paths"].items() for op in item.values()
              if op.get("security") == []]
    assert public == ["/health"]
    assert "401" not in doc["paths"]["/health"]["get"]["responses"]
    assert all("401" in op["responses"] for p, item in doc["paths"].items()
               for op in item.values() if p != "/health")
    _, open_doc = await served_document()  # no key: no security scheme to describe
    assert "security" not in open_doc
    assert "securitySchemes" not in open_doc["components"]


def test_document_bounds_come_from_the_model_once_loaded() -> None:
    from nanoserve.server import ServerConfig

    bare = document(ServerConfig("m"))
    prompt = bare["paths"]["/v1/completions"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]["properties"]["prompt"]
    assert "maximum" not in prompt["anyOf"][2]["items"]
    sized = document(ServerConfig("m"), vocab_size=100, max_model_len=64)
    body = sized["paths"]["/v1/completions"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]["properties"]
    assert body["prompt"]["anyOf"][2]["items"]["maximum"] == 99
    assert body["max_tokens"]["maximum"] == 63
    assert body["model"]["enum"] == ["m"]


BASE = {"prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0.0}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
VOCAB = stub_parts()[0].config.vocab_size
# (path, body, the server's answer): the schema must accept exactly the 200s.
BOUNDARIES: list[tuple[str, Any, int]] = [
    ("/v1/completions", BASE, 200),
    ("/v1/completions", {**BASE, "n": MAX_N}, 200),
    ("/v1/completions", {**BASE, "n": MAX_N + 1}, 400),
    ("/v1/completions", {**BASE, "n": 0}, 400),
    ("/v1/completions", {**BASE, "n": None}, 200),
    ("/v1/completions", {**BASE, "logprobs": MAX_LOGPROBS}, 200),
    ("/v1/completions", {**BASE, "logprobs": MAX_LOGPROBS + 1}, 400),
    ("/v1/completions", {**BASE, "top_p": 1}, 200),
    ("/v1/completions", {**BASE, "top_p": 0}, 400),
    ("/v1/completions", {**BASE, "top_k": -1}, 200),
    ("/v1/completions", {**BASE, "top_k": -2}, 400),
    ("/v1/completions", {**BASE, "min_p": 1}, 200),
    ("/v1/completions", {**BASE, "min_p": 1.01}, 400),
    ("/v1/completions", {**BASE, "temperature": -0.01}, 400),
    ("/v1/completions", {**BASE, "presence_penalty": 2}, 200),
    ("/v1/completions", {**BASE, "frequency_penalty": -2.01}, 400),
    ("/v1/completions", {**BASE, "repetition_penalty": 0}, 400),
    ("/v1/completions", {**BASE, "logit_bias": {"5": 100}}, 200),
    ("/v1/completions", {**BASE, "logit_bias": {"5": 100.5}}, 400),
    ("/v1/completions", {**BASE, "logit_bias": {"-5": 1}}, 400),
    ("/v1/completions", {**BASE, "stop": ["a"] * MAX_STOP_STRINGS}, 200),
    ("/v1/completions", {**BASE, "stop": ["a"] * (MAX_STOP_STRINGS + 1)}, 400),
    ("/v1/completions", {**BASE, "stop": ""}, 400),
    ("/v1/completions", {**BASE, "stop_token_ids": [VOCAB - 1]}, 200),
    ("/v1/completions", {**BASE, "stop_token_ids": [VOCAB]}, 400),
    ("/v1/completions", {**BASE, "prompt": [VOCAB - 1]}, 200),
    ("/v1/completions", {**BASE, "prompt": [VOCAB]}, 400),
    ("/v1/completions", {**BASE, "prompt": [[1], [2]]}, 200),
    ("/v1/completions", {**BASE, "prompt": [[]]}, 400),
    ("/v1/completions", {**BASE, "prompt": ""}, 400),
    ("/v1/completions", {**BASE, "prompt": [1], "max_tokens": 1023}, 200),  # max_model_len
    ("/v1/completions", {**BASE, "prompt": [1], "max_tokens": 1024}, 400),  # is 1024
    ("/v1/completions", {**BASE, "max_tokens": 0}, 400),
    ("/v1/completions", {**BASE, "seed": MIN_SEED}, 200),
    ("/v1/completions", {**BASE, "seed": MAX_SEED}, 200),
    ("/v1/completions", {**BASE, "seed": MIN_SEED - 1}, 400),
    ("/v1/completions", {**BASE, "seed": MAX_SEED + 1}, 400),
    ("/v1/completions", {**BASE, "seed": 1.5}, 400),
    ("/v1/completions", {**BASE, "suffix": None}, 200),
    ("/v1/completions", {**BASE, "prompt_logprobs": MAX_LOGPROBS, "return_token_ids": True},
     200),
    ("/v1/completions", {**BASE, "prompt_logprobs": MAX_LOGPROBS + 1}, 400),
    ("/v1/completions", {**BASE, "prompt_logprobs": -1}, 400),
    ("/v1/completions", {**BASE, "suffix": "x"}, 400),
    ("/v1/completions", {**BASE, "echo": "maybe"}, 400),
    ("/v1/completions", {**BASE, "n": True}, 400),
    ("/v1/completions", {**BASE, "model": "stub"}, 200),
    ("/v1/completions", {**BASE, "model": "other"}, 404),
    ("/v1/completions", {"max_tokens": 1}, 400),
    ("/v1/completions", [BASE], 400),  # not an object: param is null
    ("/v1/chat/completions", CHAT, 200),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400),
    ("/v1/chat/completions", {**CHAT, "messages": [{"content": "x"}]}, 400),
    ("/v1/chat/completions", {**CHAT, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}]}]}, 200),
    ("/v1/chat/completions", {**CHAT, "messages": [
        {"role": "user", "content": [{"type": "image_url"}]}]}, 400),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": MAX_LOGPROBS}, 200),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": -1}, 400),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "text"}}, 200),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, 200),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, 400),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, 400),
    ("/v1/chat/completions", {**CHAT, "tools": []}, 200),
    ("/v1/completions", {**BASE, "tools": []}, 400),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 1}, 200),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 0}, 400),
    ("/v1/responses", {"input": "hi", "previous_response_id": "resp_1"}, 400),
    ("/v1/chat/completions", {**CHAT, "prompt_logprobs": 0, "return_token_ids": True}, 200),
    ("/tokenize", {"prompt": "hi"}, 200),
    ("/tokenize", {"messages": CHAT["messages"]}, 200),
    ("/tokenize", {"prompt": 5}, 400),
    ("/tokenize", {"messages": None}, 400),
    ("/detokenize", {"tokens": [1, VOCAB - 1]}, 200),
    ("/detokenize", {"tokens": [VOCAB]}, 400),
    ("/detokenize", {"tokens": []}, 400),
]


# What vLLM's lax models also read (server/body/protocol.py): served, and not in the document.
LAX: list[tuple[str, Any]] = [
    ("/v1/completions", {**BASE, "echo": "yes"}),
    ("/v1/completions", {**BASE, "n": "2", "max_tokens": 2.0, "temperature": "0.5"}),
    ("/v1/completions", {**BASE, "seed": str(MAX_SEED), "logit_bias": {"5": "1"}}),
    ("/v1/chat/completions", {**CHAT, "logprobs": "true", "top_logprobs": "2", "stream": 0}),
]


async def test_lax_spellings_are_served_but_not_documented() -> None:
    async with serving(make_app()) as h:
        doc = (await h.request("GET", "/openapi.json")).json()
        for path, body in LAX:
            schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"][
                "schema"]
            r = await h.post(path, body)
            assert r.status == 200, (path, body, r.body)
            assert not validator(doc, schema).is_valid(body), (path, body)


async def test_request_schemas_agree_with_the_validators() -> None:
    async with serving(make_app()) as h:
        doc = (await h.request("GET", "/openapi.json")).json()
        disagree = []
        for path, body, status in BOUNDARIES:
            op = doc["paths"][path]["post"]
            schema = op["requestBody"]["content"]["application/json"]["schema"]
            r = await h.post(path, body)
            assert r.status == status, (path, body, r.body)
            if validator(doc, schema).is_valid(body) != (status == 200):
                disagree.append((path, body, status))
            # Whatever the status, the answer fits what the document says of it.
            resp = op["responses"][str(r.status)]
            fits = validator(doc, resp["content"]["application/json"]["schema"])
            assert fits.is_valid(r.json()), (path, body, r.body)
        assert disagree == []


def test_request_schemas_are_the_models_parse_validates_with() -> None:
    """One declaration: each body's documented fields are exactly the fields of the
    pydantic model that parse validates that route's bodies with."""
    from nanoserve.server import ServerConfig
    from nanoserve.server.body.protocol import protocol

    doc = document(ServerConfig("m"), vocab_size=100, max_model_len=64)
    for path, model in protocol("m", 100, 64).by_path().items():
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"][
            "schema"]
        assert set(body["properties"]) == set(model.model_fields), path
        assert set(body.get("required", [])) == {
            name for name, f in model.model_fields.items() if f.is_required()}, path
