"""Structured output with tools, composed as OpenAI composes them (issue 42, item 1): a
forced call is shaped by its tools' schemas and `response_format` is kept for a text
answer; under "auto" the output is "a call, or text in the schema". On the stub with the
official `openai` client, on a real socket (chat and Responses, unary and streamed), and
the "auto" grammar itself against strings: it admits each parser's calls and schema-valid
text, and nothing else.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import trio
from support.http_harness import stub_parts
from support.server_harness import live, make_engine

from nanoserve.sampling.grammar import Grammars, GuidedSpec
from nanoserve.server import checks
from nanoserve.server.settings import AgentSettings
from nanoserve.server.tools.constrained import after_reasoning, auto_calls, call_or_answer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["CET", "UTC"]}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
ANSWER = {"type": "object", "properties": {"answer": {"type": "integer"}},
          "required": ["answer"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def say(text: str) -> str:
    return f"⟪say⟫{text}⟪/say⟫"


# parser -> (one call, two calls) in its markup
CALLS = {
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
               '</tool_call>',
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}'
               '\n</tool_call>'),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Paris"}}',
                    '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "get_time", "parameters": {"zone": "CET"}}'),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
                '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_time", "arguments": {"zone": "CET"}}]'),
    "pythonic": ('[get_weather(city="Paris")]',
                 '[get_weather(city="Paris"), get_time(zone="CET")]'),
}
# Neither a call nor the schema's text: each is refused by every parser's grammar.
NEITHER = [
    "The answer is 42.",  # free text
    '{"answer": "42"}',  # JSON, not schema-valid
    '{"answer": 42, "extra": 1}',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": 7}}\n</tool_call>',
    '<tool_call>\n{"name": "no_such_tool", "arguments": {}}\n</tool_call>',
    '[get_time(zone="CET")]garbage',
]


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    _, tok = stub_parts()
    return Grammars(tok, tok.vocab_size)


def admits(grammars: Grammars, spec: GuidedSpec, text: str) -> bool:
    """Whether `text`, tokenized and fed to a fresh matcher, is a whole output `spec` allows."""
    m = grammars.matcher(spec)
    ids = grammars._tokenizer.encode(text)
    return bool(m.consume_tokens(ids)) and m.is_accepting() and not m.is_error()


def auto_spec(parser: str, parallel: bool = True) -> GuidedSpec:
    answer = GuidedSpec.json_schema(ANSWER, "response_format.json_schema.schema")
    return call_or_answer(auto_calls(TOOLS, parser, parallel), answer)


@pytest.mark.parametrize("parser", sorted(CALLS))
def test_auto_with_a_format_admits_a_call_or_schema_text_and_nothing_else(
        grammars: Grammars, parser: str) -> None:
    spec = auto_spec(parser)
    one, two = CALLS[parser]
    assert admits(grammars, spec, one)
    assert admits(grammars, spec, two)
    assert admits(grammars, spec, '{"answer": 42}')
    for text in NEITHER:
        assert not admits(grammars, spec, text), text
    # Another parser's markup is not this one's calls (the output would read as text).
    other = "hermes" if parser != "hermes" else "mistral"
    assert not admits(grammars, spec, CALLS[other][0])
    # Without parallel calls, one call only.
    assert admits(grammars, auto_spec(parser, parallel=False), one)
    assert not admits(grammars, auto_spec(parser, parallel=False), two)


def test_auto_with_a_format_applies_after_the_thinking(grammars: Grammars) -> None:
    spec = after_reasoning(auto_spec("hermes"), opening_optional=False)
    assert admits(grammars, spec, "<think>hm</think>\n" + CALLS["hermes"][0])
    assert admits(grammars, spec, '<think>hm</think>\n{"answer": 42}')
    assert not admits(grammars, spec, "<think>hm</think>\nforty-two")


@pytest.fixture
async def client() -> AsyncIterator[openai.OpenAI]:
    agents = AgentSettings(enable_auto_tool_choice=True)
    async with live(make_engine(), chat_template=checks.chat_template("chatml-tools"),
                    agents=agents) as (url, _):
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                           timeout=60) as cl:
            yield cl


async def chat(cl: openai.OpenAI, script: str, **kw: Any) -> tuple[Any, list[Any]]:
    """The unary choice and the streamed chunks for a scripted output."""
    body = {"model": "stub", "messages": [{"role": "user", "content": say(script)}],
            "max_tokens": 120, "temperature": 0, "tools": TOOLS, "response_format": FORMAT,
            **kw}
    unary = await trio.to_thread.run_sync(lambda: cl.chat.completions.create(**body))
    chunks = await trio.to_thread.run_sync(
        lambda: list(cl.chat.completions.create(**body, stream=True)))
    return unary.choices[0], chunks


def streamed_calls(chunks: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                call = calls.setdefault(tc.index, ["", ""])
                call[0] += tc.function.name or ""
                call[1] += tc.function.arguments or ""
    return [(n, json.loads(a)) for _, (n, a) in sorted(calls.items())]


def unary_calls(choice: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls or []]


async def test_required_with_a_format_is_a_call(client: openai.OpenAI) -> None:
    array = '[{"name": "get_time", "parameters": {"zone": "UTC"}}]'
    unary, chunks = await chat(client, array, tool_choice="required")
    want = [("get_time", {"zone": "UTC"})]
    assert unary_calls(unary) == streamed_calls(chunks) == want
    assert unary.finish_reason == "tool_calls"


async def test_named_with_a_format_is_that_call(client: openai.OpenAI) -> None:
    unary, chunks = await chat(client, '{"city": "Paris"}', tool_choice=NAMED)
    assert unary_calls(unary) == streamed_calls(chunks) == [("get_weather", {"city": "Paris"})]


async def test_auto_with_a_format_is_a_call_or_the_schema_text(client: openai.OpenAI) -> None:
    unary, chunks = await chat(client, CALLS["hermes"][0])
    assert unary_calls(unary) == streamed_calls(chunks) == [("get_weather", {"city": "Paris"})]
    unary, chunks = await chat(client, '{"answer": 42}')
    assert unary.message.tool_calls is None
    assert json.loads(unary.message.content) == {"answer": 42}
    # Text that is neither cannot come out: the stub's script is cut where the grammar
    # refuses it, so what it says is never the prose it was told to say.
    unary, _ = await chat(client, "It is 42.", max_tokens=20)
    assert "It is" not in (unary.message.content or "")


async def test_a_forced_call_still_checks_the_format(client: openai.OpenAI) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}
    with pytest.raises(openai.BadRequestError) as info:
        await chat(client, "[]", tool_choice="required", response_format=bad)
    assert info.value.body["param"] == "response_format.json_schema.schema"  # type: ignore[index]


RESPONSES_TOOLS = [{"type": "function", "name": t["function"]["name"],  # type: ignore[index]
                    "parameters": t["function"]["parameters"]} for t in TOOLS]  # type: ignore[index]
TEXT_FORMAT = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER}}


async def responses(cl: openai.OpenAI, script: str, **kw: Any) -> tuple[Any, Any]:
    args = {"model": "stub", "temperature": 0, "max_output_tokens": 80, "input": say(script),
            "tools": RESPONSES_TOOLS, "text": TEXT_FORMAT, **kw}
    unary = await trio.to_thread.run_sync(lambda: cl.responses.create(**args))

    def stream() -> Any:
        with cl.responses.stream(**args) as s:
            for _ in s:
                pass
            return s.get_final_response()

    return unary, await trio.to_thread.run_sync(stream)


def items(resp: Any) -> list[tuple[str, Any]]:
    return [(i.name, json.loads(i.arguments)) if i.type == "function_call"
            else ("text", json.loads(i.content[0].text)) for i in resp.output]


@pytest.mark.parametrize(("script", "kw", "want"), [
    ('[{"name": "get_time", "parameters": {"zone": "CET"}}]', {"tool_choice": "required"},
     [("get_time", {"zone": "CET"})]),
    ('{"city": "Paris"}', {"tool_choice": {"type": "function", "name": "get_weather"}},
     [("get_weather", {"city": "Paris"})]),
    (CALLS["hermes"][0], {}, [("get_weather", {"city": "Paris"})]),
    ('{"answer": 7}', {}, [("text", {"answer": 7})]),
])
async def test_responses_text_format_with_tools(client: openai.OpenAI, script: str,
                                                kw: dict[str, Any], want: Any) -> None:
    unary, streamed = await responses(client, script, **kw)
    assert items(unary) == items(streamed) == want


async def test_responses_errors_name_text_format(client: openai.OpenAI) -> None:
    bad = {"format": {"type": "json_schema", "name": "x", "schema": {"type": 7}}}
    with pytest.raises(openai.BadRequestError) as info:
        await responses(client, "[]", tool_choice="required", text=bad)
    assert info.value.body["param"] == "text.format.schema"  # type: ignore[index]
