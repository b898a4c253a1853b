"""Request bodies that would recurse or generate without end are 400s naming the field:
a body nested past 100 levels, and a constraint that can never be completed (before
admission when it can be known, else an error frame).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from http_harness import serving
from server_harness import GOOD, assert_error, assert_serving, make_app

CHAT = {"model": "stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def post(path: str, body: Any) -> Any:
    async with serving(make_app()) as h:
        r = await h.request("POST", path, body=body if isinstance(body, bytes)
                            else json.dumps(body).encode())
        await assert_serving(h)
        return r


# ---- depth, and constraints that can never be completed -------------------------------

def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize(("raw", "param"), [
    (b'{"prompt": "x", "deep": ' + nested(100_000) + b"}", "deep"),
    (b'{"prompt": "x", "guided_json": ' + b'{"a": ' * 980 + b"1" + b"}" * 980 + b"}",
     "guided_json"),
    (b'{"prompt": "x", "max_tokens": 1, "stop": ["]]]", "{{{"], "deep": ' + nested(100)
     + b"}", "deep"),  # 101 levels with the body's own; brackets in strings do not count
    (nested(100_000), None),
])
async def test_a_body_nested_past_100_levels_is_a_400(raw: bytes, param: str | None) -> None:
    """Before any parser recursion: 100,000 levels once took a full parse to refuse, and
    ~980 inside guided_json passed the parser and failed further in (RecursionError, 500)."""
    err = assert_error(await post("/v1/completions", raw), 400, param)
    assert err["code"] == "too_deep"
    assert err["message"] == f"{param or 'request body'}: nests deeper than 100 levels of " \
                             "arrays and objects"


async def test_100_levels_are_served() -> None:
    raw = b'{"prompt": "x", "max_tokens": 1, "deep": ' + nested(99) + b"}"
    assert (await post("/v1/completions", raw)).status == 200
    schema = json.loads(b'{"a": ' * 95 + b"1" + b"}" * 95)  # 98 deep in its body
    r = await post("/v1/completions", {**GOOD, "structured_outputs": {"json": schema}})
    assert r.status == 200, r.body


async def test_a_schema_given_as_text_is_measured_too() -> None:
    text = '{"a": ' * 980 + "1" + "}" * 980
    for field, body in (("guided_json", {**GOOD, "guided_json": text}),
                        ("structured_outputs.json", {**GOOD, "structured_outputs": {
                            "json": text}})):
        err = assert_error(await post("/v1/completions", body), 400, field)
        assert err["message"] == f"{field}: nests deeper than 100 levels of arrays and objects"


ENDLESS = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}


@pytest.mark.parametrize(("body", "param"), [
    ({**GOOD, "guided_json": ENDLESS}, "guided_json"),
    ({**GOOD, "guided_json": json.dumps(ENDLESS)}, "guided_json"),
    ({**GOOD, "structured_outputs": {"json": ENDLESS}}, "structured_outputs.json"),
])
async def test_a_schema_with_no_finite_instance_is_a_400_before_admission(
        body: Any, param: str) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    err = assert_error(await post(path, {**body, "stream": True}), 400, param)
    assert err["message"] == (f"{param}: no finite JSON value satisfies this schema: a "
                              "required property or item leads back into it without end")


ENDLESS_LARK = 'start: /[a-z]{1,12}/ "-" a\na: "x" a'  # no finite sentence, and no check sees it


async def test_a_grammar_found_endless_while_generating_ends_cleanly() -> None:
    """Unary: a 400 naming the field (was a 500 engine_error). Streamed: the frames so far,
    then an error frame naming the field, then [DONE]."""
    body = {**GOOD, "max_tokens": 30, "seed": 0, "guided_grammar": ENDLESS_LARK}
    async with serving(make_app()) as h:
        err = assert_error(await h.post("/v1/completions", body), 400, "guided_grammar")
        assert err["message"].startswith("guided_grammar: the constraint cannot be followed "
                                         "(it gave up at output token ")
        r = await h.post("/v1/completions", {**body, "stream": True})
        assert r.status == 200
        events = r.events()
        assert events[-1] == "[DONE]"
        frames = [json.loads(e) for e in events[:-1]]
        assert all("choices" in f for f in frames[:-1])
        assert len(frames) > 2  # some text went out before the grammar gave up
        assert frames[-1]["error"]["param"] == "guided_grammar"
        assert frames[-1]["error"]["code"] == "invalid_value"
        await assert_serving(h)
