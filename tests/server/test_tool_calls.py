"""Tool calling and reasoning through `/v1/chat/completions`, on a real Hypercorn socket with
the official `openai` client, on the stub.

The stub says what a prompt scripts (`⟪say⟫...⟪/say⟫`, model/stub.py): each parser's markup,
single and parallel calls, then, scripted by the tool's result, the final answer of the
loop's second turn. Every call must come back with its exact name and arguments, unary
and streamed, and the streamed deltas must join to the unary message.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from support.server_harness import live, make_engine

from nanoserve.server import checks
from nanoserve.server.settings import AgentSettings
from nanoserve.server.tools.output import OutputPlan

TEMPLATE = checks.chat_template("chatml-tools")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Today's weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["CET", "UTC"]}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
PARIS = ("get_weather", {"city": "Paris"})
CET = ("get_time", {"zone": "CET"})

# parser -> (scripted output, content, calls)
SCRIPTS: dict[str, list[tuple[str, str, list[tuple[str, dict[str, Any]]]]]] = {
    "hermes": [
        ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
         '\n</tool_call>', "Let me check.", [PARIS]),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>', "",
         [PARIS, CET]),
    ],
    "llama3_json": [
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [PARIS]),
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}; '
         '{"name": "get_time", "parameters": {"zone": "CET"}}', "", [PARIS, CET]),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', "", [PARIS]),
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
         '{"name": "get_time", "arguments": {"zone": "CET"}}]', "", [PARIS, CET]),
    ],
    "pythonic": [
        ('[get_weather(city="Paris")]', "", [PARIS]),
        ('[get_weather(city="Paris"), get_time(zone="CET")]', "", [PARIS, CET]),
    ],
}


def say(text: str) -> str:
    return f"⟪say⟫{text}⟪/say⟫"


@pytest.fixture
async def server(request: pytest.FixtureRequest) -> AsyncIterator[openai.OpenAI]:
    agents = AgentSettings(**getattr(request, "param", {"enable_auto_tool_choice": True}))
    async with live(make_engine(), chat_template=TEMPLATE, agents=agents) as (url, _):
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                           timeout=60) as cl:
            yield cl


async def in_thread(fn: Any) -> Any:
    import trio

    return await trio.to_thread.run_sync(fn)


def join_stream(chunks: list[Any]) -> dict[str, Any]:
    """A streamed choice's message, joined as the openai client's users join it."""
    msg: dict[str, Any] = {"content": "", "reasoning_content": "", "calls": {}}
    for chunk in chunks:
        for c in chunk.choices:
            d = c.delta
            msg["content"] += d.content or ""
            msg["reasoning_content"] += getattr(d, "reasoning_content", None) or ""
            for tc in d.tool_calls or []:
                call = msg["calls"].setdefault(tc.index, {"id": None, "name": "", "args": ""})
                if tc.id:
                    assert call["id"] is None  # the id and name come once, first
                    call["id"], call["name"] = tc.id, tc.function.name
                call["args"] += tc.function.arguments or ""
            if c.finish_reason is not None:
                msg["finish_reason"] = c.finish_reason
    return msg


async def ask(cl: openai.OpenAI, messages: list[Any], **kw: Any) -> tuple[Any, dict[str, Any]]:
    """The unary answer and the streamed one, joined."""
    base = {"model": "stub", "messages": messages, "max_tokens": 120, "temperature": 0, **kw}
    unary = await in_thread(lambda: cl.chat.completions.create(**base))
    chunks = await in_thread(lambda: list(cl.chat.completions.create(**base, stream=True)))
    return unary.choices[0], join_stream(chunks)


def assert_same(unary: Any, streamed: dict[str, Any], content: str,
                calls: list[tuple[str, dict[str, Any]]]) -> None:
    msg = unary.message
    got = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []]
    assert got == calls
    assert (msg.content or "") == content == streamed["content"]
    joined = [(c["name"], json.loads(c["args"])) for _, c in sorted(streamed["calls"].items())]
    assert joined == calls
    assert all(c.id.startswith("call_") and c.type == "function" for c in msg.tool_calls or [])
    want = "tool_calls" if calls else "stop"
    assert unary.finish_reason == streamed["finish_reason"] == want


@pytest.mark.parametrize("parser", sorted(SCRIPTS))
async def test_a_two_turn_tool_loop_with_each_parser(parser: str) -> None:
    agents = AgentSettings(tool_call_parser=parser, enable_auto_tool_choice=True)
    async with live(make_engine(), chat_template=TEMPLATE, agents=agents) as (url, _):
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as cl:
            for script, content, calls in SCRIPTS[parser]:
                messages: list[Any] = [{"role": "user", "content": say(script)}]
                unary, streamed = await ask(cl, messages, tools=TOOLS)
                assert_same(unary, streamed, content, calls)
                # the second turn: the calls and their results go back; the results script
                # the final answer
                messages.append(unary.message.model_dump(exclude_none=True))
                messages += [{"role": "tool", "tool_call_id": c.id,
                              "content": f"done {i} " + say(f"Answer {i}.")}
                             for i, c in enumerate(unary.message.tool_calls)]
                final, streamed = await ask(cl, messages, tools=TOOLS)
                assert_same(final, streamed, f"Answer {len(calls) - 1}.", [])


async def test_required_and_named_are_enforced_and_read_back(server: openai.OpenAI) -> None:
    cl = server
    array = ('[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
             '{"name": "get_time", "parameters": {"zone": "CET"}}]')
    unary, streamed = await ask(cl, [{"role": "user", "content": say(array)}], tools=TOOLS,
                                tool_choice="required")
    assert_same(unary, streamed, "", [PARIS, CET])
    named = {"type": "function", "function": {"name": "get_weather"}}
    unary, streamed = await ask(cl, [{"role": "user", "content": say('{"city": "Paris"}')}],
                                tools=TOOLS, tool_choice=named)
    assert_same(unary, streamed, "", [PARIS])
    # What the grammar cannot let through: the script's zone "PST" is not in the enum, and
    # without parallel calls a second call cannot start.
    bad = '[{"name": "get_time", "parameters": {"zone": "PST"}}]'
    unary, _ = await ask(cl, [{"role": "user", "content": say(bad)}], tools=TOOLS,
                         tool_choice="required", parallel_tool_calls=False, max_tokens=40)
    for call in unary.message.tool_calls or []:
        assert call.function.name in ("get_weather", "get_time")
        assert "PST" not in call.function.arguments


async def test_none_leaves_the_markup_as_content(server: openai.OpenAI) -> None:
    script, _, _ = SCRIPTS["hermes"][0]
    unary, streamed = await ask(server, [{"role": "user", "content": say(script)}],
                                tools=TOOLS, tool_choice="none")
    assert unary.message.content == streamed["content"] == script
    assert unary.message.tool_calls is None


BAD = [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strang"}}}}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "messages": [{"role": "user", "content": "x"},
                                   {"role": "tool", "content": "18C"}]},
     "messages[1].tool_call_id"),
]


@pytest.mark.parametrize(("extra", "param"), BAD)
async def test_bad_tool_requests_are_a_400_naming_the_field(
        server: openai.OpenAI, extra: dict[str, Any], param: str) -> None:
    body = {"model": "stub", "messages": [{"role": "user", "content": "x"}], **extra}
    with pytest.raises(openai.BadRequestError) as info:
        await in_thread(lambda: server.chat.completions.create(**body))
    assert info.value.body["param"] == param  # type: ignore[index]


@pytest.mark.parametrize("server", [{}], indirect=True)
async def test_auto_needs_the_flag_and_a_template_that_renders_tools(
        server: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await in_thread(lambda: server.chat.completions.create(
            model="stub", messages=[{"role": "user", "content": "x"}], tools=TOOLS))
    assert "--enable-auto-tool-choice" in info.value.body["message"]  # type: ignore[index]


async def test_a_template_without_tools_is_a_400_not_a_silent_drop() -> None:
    agents = AgentSettings(enable_auto_tool_choice=True)
    async with live(make_engine(), agents=agents) as (url, _):  # SmolLM2's own template
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as cl:
            with pytest.raises(openai.BadRequestError) as info:
                await in_thread(lambda: cl.chat.completions.create(
                    model="stub", messages=[{"role": "user", "content": "x"}], tools=TOOLS))
            assert info.value.body["param"] == "tools"  # type: ignore[index]
            assert "chatml-tools" in info.value.body["message"]  # type: ignore[index]


@pytest.mark.parametrize("server", [{"reasoning_parser": "qwen3"}], indirect=True)
async def test_reasoning_is_split_and_a_schema_applies_after_it(server: openai.OpenAI
                                                               ) -> None:
    unary, streamed = await ask(server, [{"role": "user", "content": say(
        "<think>\nParis is in France.\n</think>\n\nThe answer.")}])
    assert unary.message.reasoning_content == streamed["reasoning_content"] == (
        "Paris is in France.")
    assert unary.message.content == streamed["content"] == "The answer."
    # The thinking is free text (not JSON); the schema binds what follows </think>.
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": WEATHER[
        "function"]["parameters"]}}  # type: ignore[index]
    unary, streamed = await ask(server, [{"role": "user", "content": say(
        '<think>not json at all</think>{"city": "Paris"}')}], response_format=fmt)
    assert unary.message.reasoning_content == "not json at all"
    assert json.loads(unary.message.content) == {"city": "Paris"}
    assert streamed["content"] == unary.message.content
    # A required call, likewise after the thinking.
    array = '[{"name": "get_time", "parameters": {"zone": "UTC"}}]'
    unary, streamed = await ask(server, [{"role": "user", "content": say(
        f"<think>which zone?</think>{array}")}], tools=TOOLS, tool_choice="required")
    assert unary.message.reasoning_content == streamed["reasoning_content"] == "which zone?"
    assert_same(unary, streamed, "", [("get_time", {"zone": "UTC"})])
    # qwen3 with its thinking switched off: no <think> at all, the call straight away
    unary, streamed = await ask(server, [{"role": "user", "content": say(array)}],
                                tools=TOOLS, tool_choice="required")
    assert unary.message.reasoning_content is None
    assert_same(unary, streamed, "", [("get_time", {"zone": "UTC"})])


def test_call_ids_are_the_same_in_every_reading_of_a_response() -> None:
    a = OutputPlan("auto", "hermes").start("chatcmpl-7", 0)
    b = OutputPlan("auto", "hermes").start("chatcmpl-7", 0)
    text = SCRIPTS["hermes"][1][0]
    a.feed(text)
    a.finish()
    for ch in text:
        b.feed(ch)
    b.finish()
    assert a.calls() == b.calls()
    assert len({c.id for c in a.calls()}) == 2
