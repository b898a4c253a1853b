"""`tool_choice` "required" and a named function on SmolLM2's real weights (its GGUF's
blocks, as `serve` runs them), sampled at
temperature 0.8, through the official client on a real socket: 50 requests over 5 tools
with nested, enum and array parameters, and every argument string valid under its
function's schema (jsonschema). SmolLM2-135M was not trained on tools: validity here is
the grammar engine's, which is the point of enforcing them."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
import trio
from support.server_harness import live

from nanoserve.config import EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.server import checks
from nanoserve.tokenizer import Tokenizer

NAME = {"type": "string", "minLength": 1, "maxLength": 16}


def fn(name: str, props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": props, "required": required,
        "additionalProperties": False}}}


TOOLS = [
    fn("get_weather", {"city": NAME, "unit": {"enum": ["celsius", "fahrenheit"]}},
       ["city", "unit"]),
    fn("book_table", {"guest": {"type": "object", "properties": {
        "name": NAME, "party": {"type": "integer", "minimum": 1, "maximum": 12}},
        "required": ["name", "party"], "additionalProperties": False},
        "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}}, ["guest", "time"]),
    fn("tag_photos", {"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
       ["tags"]),
    fn("convert", {"amount": {"type": "number", "minimum": 0, "maximum": 1e6},
                   "to": {"enum": ["EUR", "USD", "JPY"]}}, ["amount", "to"]),
    fn("set_alarm", {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                     "repeat": {"type": "boolean"},
                     "days": {"type": "array", "items": {"enum": ["mon", "tue", "wed"]},
                              "maxItems": 3}}, ["hour", "repeat"]),
]
ASKS = ["What's the weather in Lyon?", "A table for four at eight, please.",
        "Tag my beach photos.", "How much is 120 dollars in yen?", "Wake me at six."]


@pytest.mark.real
async def test_required_and_named_calls_validate_at_temperature(
        smollm2_quantized: Any, smollm2_tokenizer: Tokenizer) -> None:
    engine = Engine(smollm2_quantized, smollm2_tokenizer,
                    EngineConfig(block_size=16, num_blocks=512, max_model_len=2048))
    template = checks.chat_template("chatml-tools")
    async with live(engine, name="smollm2", chat_template=template) as (url, _):
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                           timeout=300) as cl:
            results: list[tuple[int, Any]] = []
            # The clients' own threads: trio's default limiter is also the one the engine's
            # steps take a thread from, and 40 blocked clients would starve it.
            clients = trio.CapacityLimiter(16)

            async def one(i: int) -> None:
                k = i % 5
                choice: Any = ("required" if i < 25 else
                               {"type": "function", "function": {"name": TOOLS[k][
                                   "function"]["name"]}})
                resp = await trio.to_thread.run_sync(lambda: cl.chat.completions.create(
                    model="smollm2", messages=[{"role": "user", "content": ASKS[k]}],
                    tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                    temperature=0.8, seed=i, max_tokens=120), limiter=clients)
                results.append((i, resp.choices[0]))

            async with trio.open_nursery() as n:
                for i in range(50):
                    n.start_soon(one, i)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    valid = 0
    for i, choice in sorted(results, key=lambda r: r[0]):
        calls = choice.message.tool_calls or []
        assert len(calls) == 1, (i, choice)
        assert choice.finish_reason == "tool_calls", (i, choice)
        if i >= 25:
            assert calls[0].function.name == TOOLS[i % 5]["function"]["name"]
        jsonschema.validate(json.loads(calls[0].function.arguments),
                            schemas[calls[0].function.name])
        valid += 1
    assert valid == 50
    s = engine.statistics()
    assert s.free_blocks == s.num_blocks


@pytest.mark.real
async def test_the_responses_api_on_smollm2(smollm2_quantized: Any,
                                            smollm2_tokenizer: Tokenizer) -> None:
    """`responses.create` and `responses.stream` with text, a json_schema `text.format`
    and a function tool (required), greedy: the stream's final response is the unary one."""
    engine = Engine(smollm2_quantized, smollm2_tokenizer,
                    EngineConfig(block_size=16, num_blocks=256, max_model_len=2048))
    template = checks.chat_template("chatml-tools")
    weather = {"type": "function", **TOOLS[0]["function"]}
    city = {"type": "json_schema", "name": "city", "schema": TOOLS[0]["function"][
        "parameters"]}
    cases: list[dict[str, Any]] = [
        {"input": "What is the capital of France?", "instructions": "Answer in one line."},
        {"input": "A city and a unit, as JSON.", "text": {"format": city}},
        {"input": "Weather in Lyon?", "tools": [weather], "tool_choice": "required"},
    ]
    async with live(engine, name="smollm2", chat_template=template) as (url, _):
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                           timeout=300) as cl:
            for case in cases:
                kw = {"model": "smollm2", "temperature": 0, "max_output_tokens": 60, **case}
                unary = await trio.to_thread.run_sync(
                    lambda kw=kw: cl.responses.create(**kw))

                def stream(kw: dict[str, Any] = kw) -> Any:
                    with cl.responses.stream(**kw) as s:
                        types = [e.type for e in s]
                        assert types[:2] == ["response.created", "response.in_progress"]
                        assert types[-1] == "response.completed"
                        return s.get_final_response()

                final = await trio.to_thread.run_sync(stream)
                assert unary.status == final.status == "completed", unary
                assert unary.output_text == final.output_text
                if "text" in case:
                    jsonschema.validate(json.loads(unary.output_text), city["schema"])
                if "tools" in case:
                    calls = [i for i in unary.output if i.type == "function_call"]
                    assert [c.name for c in calls] == ["get_weather"]
                    jsonschema.validate(json.loads(calls[0].arguments), city["schema"])
                    assert [(c.name, c.arguments) for c in final.output
                            if c.type == "function_call"] == [
                        (c.name, c.arguments) for c in calls]
                else:
                    assert unary.output_text
