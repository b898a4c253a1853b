"""`POST /v1/responses` through the official `openai` client on a real Hypercorn socket, on
the stub (scripted outputs, model/stub.py): text, a json_schema `text.format` and a
function tool, with `responses.create` and `responses.stream`; the streamed events come in
the documented order and build the unary answer; the stateless endpoint refuses
`previous_response_id` naming it, and a named tool not among the tools naming
`tool_choice.name`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import trio
from support.server_harness import live, make_engine

from nanoserve.server import checks
from nanoserve.server.settings import AgentSettings

WEATHER = {"type": "function", "name": "get_weather", "description": "Today's weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def say(text: str) -> str:
    return f"⟪say⟫{text}⟪/say⟫"


@pytest.fixture
async def client() -> AsyncIterator[openai.OpenAI]:
    agents = AgentSettings(enable_auto_tool_choice=True)
    async with live(make_engine(), chat_template=checks.chat_template("chatml-tools"),
                    agents=agents) as (url, _):
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                           timeout=60) as cl:
            yield cl


async def both(cl: openai.OpenAI, **kw: Any) -> tuple[Any, Any, list[str]]:
    """The unary response, the streamed one's final response, and its event types."""
    args = {"model": "stub", "temperature": 0, "max_output_tokens": 80, **kw}
    unary = await trio.to_thread.run_sync(lambda: cl.responses.create(**args))

    def stream() -> tuple[Any, list[str]]:
        with cl.responses.stream(**args) as s:
            types = [e.type for e in s]
            return s.get_final_response(), types

    final, types = await trio.to_thread.run_sync(stream)
    return unary, final, types


def outputs(resp: Any) -> Any:
    """The output items without their ids (a streamed and a unary response differ there)
    and the client's own parsed fields (its stream helper adds them)."""

    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items()
                    if k not in ("id", "call_id", "parsed", "parsed_arguments")}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    return strip([item.model_dump() for item in resp.output])


async def test_text(client: openai.OpenAI) -> None:
    unary, final, types = await both(client, input=say("Hello there."),
                                     instructions="Be brief.")
    assert unary.output_text == final.output_text == "Hello there."
    assert unary.status == final.status == "completed"
    assert outputs(unary) == outputs(final)
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] *
                     (len(types) - 8), "response.output_text.done",
                     "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert unary.usage.output_tokens == final.usage.output_tokens > 0


async def test_json_schema_format(client: openai.OpenAI) -> None:
    fmt = {"format": {"type": "json_schema", "name": "city", "schema": WEATHER["parameters"]}}
    unary, final, _ = await both(client, input=say('{"city": "Paris"}'), text=fmt)
    assert json.loads(unary.output_text) == json.loads(final.output_text) == {"city": "Paris"}


async def test_a_function_tool(client: openai.OpenAI) -> None:
    unary, final, types = await both(client, input=say("Checking." + CALL), tools=[WEATHER])
    calls = [i for i in unary.output if i.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})]
    assert outputs(unary) == outputs(final)
    assert "response.function_call_arguments.delta" in types
    assert types.index("response.function_call_arguments.done") < types.index(
        "response.completed")
    # the loop's next turn: the call and its output go back as input items
    follow = [{"role": "user", "content": "weather?"},
              {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
               "arguments": calls[0].arguments},
              {"type": "function_call_output", "call_id": calls[0].call_id,
               "output": "18C " + say("It is 18C.")}]
    unary, final, _ = await both(client, input=follow, tools=[WEATHER])
    assert unary.output_text == final.output_text == "It is 18C."


async def test_previous_response_id_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await trio.to_thread.run_sync(lambda: client.responses.create(
            model="stub", input="x", previous_response_id="resp_1"))
    assert info.value.body["param"] == "previous_response_id"  # type: ignore[index]


async def test_a_named_tool_not_among_tools_is_refused_once(client: openai.OpenAI) -> None:
    """The chat plan's one check of a named tool (tools/plan.py), in the Responses API's
    spelling of the field."""
    with pytest.raises(openai.BadRequestError) as info:
        await trio.to_thread.run_sync(lambda: client.responses.create(
            model="stub", input="x", tools=[WEATHER],  # type: ignore[list-item]
            tool_choice={"type": "function", "name": "g"}))
    body: Any = info.value.body
    assert body["param"] == "tool_choice.name"
    assert "'g', which is not among tools (get_weather)" in body["message"]
