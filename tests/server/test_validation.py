"""Request bodies as vLLM reads them, and errors that say exactly what is wrong.

- Types are lax where vLLM's pydantic models are ("true", "2", 2.0) and strict where a
  reading would be a guess (a boolean for a count, a number for a string).
- Every bad item of a field is named (a few, then how many more), and `param` is the path
  of the bad value (`response_format.json_schema.name`), not only its top-level field.
- A seed is a signed 64-bit integer, as in vLLM.
- A body nested past 100 levels, and a constraint that can never be completed, are 400s
  that name the field (before admission when it can be known, else an error frame).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from support.http_harness import serving
from support.server_harness import GOOD, assert_error, assert_serving, make_app, make_engine

CHAT = {"model": "stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
MAX_SEED = 2**63 - 1


async def post(path: str, body: Any) -> Any:
    async with serving(make_app()) as h:
        r = await h.request("POST", path, body=body if isinstance(body, bytes)
                            else json.dumps(body).encode())
        await assert_serving(h)
        return r


# ---- types: what vLLM's lax models accept ---------------------------------------------

async def test_lax_spellings_are_read_as_vllm_reads_them() -> None:
    body = {**GOOD, "n": "2", "max_tokens": 3.0, "temperature": "0", "echo": "1",
            "logprobs": "1", "stream": "false", "seed": " 7 ", "top_p": "1",
            "ignore_eos": "yes", "logit_bias": {"5": "-1.5"}, "stop_token_ids": ["7"]}
    r = await post("/v1/completions", body)
    assert r.status == 200, r.body
    choices = r.json()["choices"]
    assert len(choices) == 2  # n
    assert all(c["text"].startswith(GOOD["prompt"]) for c in choices)  # echo
    assert all(len(c["logprobs"]["top_logprobs"][-1]) == 1 for c in choices)  # logprobs=1
    assert r.json()["usage"]["completion_tokens"] == 6  # 2 x max_tokens 3
    chat = await post("/v1/chat/completions", {**CHAT, "logprobs": "true",
                                               "top_logprobs": "2", "stream": 0})
    assert chat.status == 200, chat.body
    content = chat.json()["choices"][0]["logprobs"]["content"]
    assert [len(t["top_logprobs"]) for t in content] == [2, 2]


@pytest.mark.parametrize(("body", "param", "message"), [
    # A boolean is never a count or a number (vLLM would read 1; OpenAI refuses it).
    ({**GOOD, "n": True}, "n", "n: Input should be an integer, not a boolean (got True)"),
    ({**GOOD, "logprobs": True}, "logprobs",
     "logprobs: Input should be an integer, not a boolean (got True)"),
    ({**GOOD, "temperature": False}, "temperature",
     "temperature: Input should be a number, not a boolean (got False)"),
    ({**GOOD, "n": 2.5}, "n",
     "n: Input should be a valid integer, got a number with a fractional part (got 2.5)"),
    ({**GOOD, "max_tokens": "ten"}, "max_tokens", "max_tokens: Input should be a valid "
     "integer, unable to parse string as an integer (got 'ten')"),
    ({**GOOD, "echo": "maybe"}, "echo",
     "echo: Input should be a valid boolean, unable to interpret input (got 'maybe')"),
    ({**GOOD, "stream": 2}, "stream",
     "stream: Input should be a valid boolean, unable to interpret input (got 2)"),
    ({**GOOD, "top_p": "high"}, "top_p",
     "top_p: Input should be a valid number, unable to parse string as a number (got 'high')"),
    ({**GOOD, "temperature": "NaN"}, "temperature", "temperature must be >= 0, got nan"),
    # Strings stay strings (as in vLLM).
    ({**GOOD, "model": 3}, "model", "model must be a string, got 3"),
    ({**GOOD, "prompt": 5}, "prompt", "prompt: Input should be a valid string (got 5); "
     "prompt must be a non-empty string, a list of strings, a list of token ids, or a list "
     "of such lists"),
])
async def test_what_is_truly_invalid_stays_a_400(body: Any, param: str, message: str) -> None:
    err = assert_error(await post("/v1/completions", body), 400, param)
    assert err["message"] == message


# ---- every bad item named --------------------------------------------------------------

@pytest.mark.parametrize(("path", "body", "param", "message"), [
    ("/v1/completions", {**GOOD, "logit_bias": {"x": 1, "5": 1, "-5": 2, "y": 3}},
     "logit_bias", "logit_bias keys must be token ids >= 0 (int or decimal string), got "
     "'x', '-5', 'y'"),
    ("/v1/completions", {**GOOD, "logit_bias": {"5": 500, "6": 1, "7": -101}}, "logit_bias",
     "logit_bias values must be numbers in [-100.0, 100.0], got 500 (bias of token 5), -101 "
     "(bias of token 7)"),
    ("/v1/completions", {**GOOD, "logit_bias": {"5": "x", "6": True, "7": 1}}, "logit_bias",
     'logit_bias["5"]: Input should be a valid number, unable to parse string as a number '
     '(got \'x\'); logit_bias["6"]: Input should be a number, not a boolean (got True); '
     "logit_bias must be an object of token id (a decimal string) -> number"),
    ("/v1/completions", {**GOOD, "logit_bias": {str(i): 1 for i in range(49150, 49160)}},
     "logit_bias", "logit_bias: token ids 49152, 49153, 49154, 49155, 49156 and 3 more are "
     "outside the vocabulary [0, 49152)"),
    ("/v1/completions", {**GOOD, "stop_token_ids": [-1, 5, -2]}, "stop_token_ids",
     "stop_token_ids must be integers >= 0 (each token id), got [0] -1, [2] -2"),
    ("/v1/completions", {**GOOD, "stop_token_ids": ["a", 5, "b"]}, "stop_token_ids",
     "stop_token_ids[0]: Input should be a valid integer, unable to parse string as an "
     "integer (got 'a'); stop_token_ids[2]: Input should be a valid integer, unable to parse "
     "string as an integer (got 'b')"),
    ("/v1/completions", {**GOOD, "stop_token_ids": [10**7, 5, 10**8]}, "stop_token_ids",
     "stop_token_ids: token ids 10000000, 100000000 are outside the vocabulary [0, 49152)"),
    ("/v1/completions", {**GOOD, "prompt": [10**7, 5, 10**8]}, "prompt",
     "prompt: token ids 10000000, 100000000 are outside the vocabulary [0, 49152)"),
    ("/v1/completions", {**GOOD, "stop": ["a", "", ""]}, "stop",
     "stop strings must be non-empty, got ['a', '', ''] ([1], [2] empty)"),
    ("/v1/completions", {**GOOD, "guided_choice": ["", "a", ""]}, "guided_choice",
     "guided_choice[0]: String should have at least 1 character (got ''); guided_choice[2]: "
     "String should have at least 1 character (got '')"),
    ("/detokenize", {"tokens": [10**7, 1, 10**8]}, "tokens",
     "tokens: token ids 10000000, 100000000 are outside the vocabulary [0, 49152)"),
    ("/v1/chat/completions", {**CHAT, "messages": [
        {"content": "x"}, {"role": 5}, {"role": "user", "content": 7}]}, "messages",
     "messages[0].role is required; messages[1].role: Input should be a valid string (got "
     "5); messages[2].content: Input should be a valid string (got 7); messages must be a "
     "non-empty list of {role, content} objects, content a string, a list of text parts, or "
     "null"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user"}] + [{}] * 7}, "messages",
     "messages[1].role is required; messages[2].role is required; messages[3].role is "
     "required; messages[4].role is required; messages[5].role is required; and 2 more; "
     "messages must be a non-empty list of {role, content} objects, content a string, a list "
     "of text parts, or null"),
])
async def test_every_bad_item_is_named(path: str, body: Any, param: str, message: str) -> None:
    err = assert_error(await post(path, body), 400, param)
    assert err["message"] == message


# ---- integer ranges --------------------------------------------------------------------

@pytest.mark.parametrize(("seed", "n", "status"), [
    (MAX_SEED, 1, 200), (-MAX_SEED - 1, 1, 200), (MAX_SEED, 3, 200),  # children wrap
    (MAX_SEED + 1, 1, 400), (-MAX_SEED - 2, 1, 400), (2**70, 1, 400), (str(2**64), 1, 400),
])
async def test_seed_is_a_signed_64_bit_integer(seed: Any, n: int, status: int) -> None:
    r = await post("/v1/completions", {**GOOD, "seed": seed, "n": n, "temperature": 1.0})
    if status == 200:
        assert r.status == 200, r.body
        assert len(r.json()["choices"]) == n
    else:
        err = assert_error(r, 400, "seed")
        assert err["message"] == f"seed must be in [-2**63, 2**63 - 1] (or null), got {seed}"


async def test_seeds_are_not_wrapped_into_another_seed() -> None:
    """2**64 + 7 once drew seed 7's tokens (the sampler hashes seeds modulo 2**64)."""
    async with serving(make_app()) as h:
        seven = await h.post("/v1/completions", {**GOOD, "seed": 7, "temperature": 1.0})
        assert seven.status == 200
        assert_error(await h.post("/v1/completions", {**GOOD, "seed": 2**64 + 7,
                                                      "temperature": 1.0}), 400, "seed")


@pytest.mark.parametrize(("field", "value", "param"), [
    ("n", 2**63, "n"), ("top_k", -(2**63), "top_k"), ("max_tokens", 2**63, "max_tokens"),
    ("min_tokens", 2**63, "min_tokens"), ("logprobs", 2**63, "logprobs"),
    ("best_of", 2**63, "best_of"), ("stop_token_ids", [2**63], "stop_token_ids"),
    ("prompt", [2**63], "prompt"), ("logit_bias", {str(2**63): 1}, "logit_bias"),
])
async def test_every_integer_field_refuses_64_bit_overflow(field: str, value: Any,
                                                           param: str) -> None:
    assert_error(await post("/v1/completions", {**GOOD, field: value}), 400, param)


async def test_a_top_k_past_the_vocabulary_keeps_every_token() -> None:
    same = [await post("/v1/completions", {**GOOD, "temperature": 1.0, "seed": 3, "top_k": k})
            for k in (0, 2**70)]
    assert [r.status for r in same] == [200, 200]
    assert same[0].json()["choices"] == same[1].json()["choices"]


# ---- nested fields named by their paths -----------------------------------------------

@pytest.mark.parametrize(("path", "body", "param", "message"), [
    ("/v1/chat/completions", {**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"schema": {"type": "object"}}}},
     "response_format.json_schema.name", "response_format.json_schema.name is required"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}},
     "response_format.json_schema", "response_format.json_schema is required when "
     "response_format.type is json_schema"),
    ("/v1/chat/completions", {**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema", "response_format.json_schema.schema: Invalid "
     "type: nope"),
    ("/v1/chat/completions", {**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "", "strict": True}}},
     "response_format.json_schema.name", "response_format.json_schema.name: String should "
     "have at least 1 character (got '')"),
    ("/v1/chat/completions", {**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "bogus": 1}}},
     "response_format.json_schema.bogus", "response_format.json_schema.bogus: Extra inputs "
     "are not permitted (got 1)"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}},
     "response_format.type", "response_format.type: Input should be 'text', 'json_object' "
     "or 'json_schema' (got 'xml')"),
    ("/v1/completions", {**GOOD, "stream": True, "stream_options": {"include_usage": "x"}},
     "stream_options.include_usage", "stream_options.include_usage: Input should be a valid "
     "boolean, unable to interpret input (got 'x')"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]},
     "messages[0].content", "messages[0].content: Input should be a valid string (got 5); "
     "messages must be a non-empty list of {role, content} objects, content a string, a "
     "list of text parts, or null"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url"}]}]},
     "messages[0].content", "messages[0].content: Input should be 'text' (got 'image_url'); "
     "messages must be a non-empty list of {role, content} objects, content a string, a list "
     "of text parts, or null"),
    ("/v1/completions", {**GOOD, "structured_outputs": {"regex": ""}},
     "structured_outputs.regex", "structured_outputs.regex: String should have at least 1 "
     "character (got '')"),
    ("/v1/completions", {**GOOD, "structured_outputs": {"json": 5}},
     "structured_outputs.json", "structured_outputs.json: Input should be a valid dictionary "
     "(got 5)"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": "x"}, "max_tokens",
     "max_tokens: Input should be a valid integer, unable to parse string as an integer (got "
     "'x')"),
])
async def test_a_nested_field_is_named_by_its_path(path: str, body: Any, param: str,
                                                   message: str) -> None:
    err = assert_error(await post(path, body), 400, param)
    assert err["message"] == message


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
    ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": ENDLESS}}}, "response_format.json_schema.schema"),
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


async def test_chat_on_a_model_without_a_chat_template_is_a_400_naming_completions() -> None:
    # A base model (the embedded gemma3-270m): vLLM answers 400 too
    engine = make_engine()
    tok = copy.copy(engine.tokenizer)
    tok.chat_template = None
    engine.tokenizer = tok
    async with serving(make_app(engine)) as h:
        err = assert_error(await h.post("/v1/chat/completions", CHAT), 400, "messages")
        assert err["message"] == ("this model has no chat template (a base model): use "
                                  "/v1/completions, or start the server with --chat-template")
        await assert_serving(h)
