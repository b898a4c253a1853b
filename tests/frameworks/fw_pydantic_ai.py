"""Pydantic AI on nanoserve through both of its OpenAI models (Chat Completions and
Responses): a plain run, a streamed run, a tool loop (the agent runs the tool and sends its
result back), output types in each mode (`NativeOutput`: the response format; `ToolOutput`:
a forced output tool; `PromptedOutput`), and `NativeOutput` with tools."""

from __future__ import annotations

from typing import Any

from common import (
    FINAL,
    HELLO,
    HERMES_CALL,
    MODEL,
    PARIS,
    WEATHER_JSON,
    ToolLog,
    Weather,
    run_per_api,
    say,
)
from pydantic_ai import Agent, NativeOutput, PromptedOutput, ToolOutput
from pydantic_ai.messages import ToolCallPart, ToolReturnPart
from pydantic_ai.models import Model
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings

GREEDY = ModelSettings(temperature=0, max_retries=0)
# The output tool's call as the forced (tool_choice "required") grammar shapes it.
OUTPUT_CALL = '[{"name": "final_result", "parameters": ' + WEATHER_JSON + "}]"


def model(base_url: str, api: str) -> Model:
    provider = OpenAIProvider(base_url=base_url, api_key="unused")
    if api == "chat":
        return OpenAIChatModel(MODEL, provider=provider)
    return OpenAIResponsesModel(MODEL, provider=provider)


async def plain(base_url: str, api: str) -> dict[str, Any]:
    out = await Agent(model(base_url, api), model_settings=GREEDY).run(say(HELLO))
    assert out.output == HELLO, out.output
    return {"output": out.output}


async def streamed(base_url: str, api: str) -> dict[str, Any]:
    agent = Agent(model(base_url, api), model_settings=GREEDY)
    async with agent.run_stream(say(HELLO)) as result:
        deltas = [d async for d in result.stream_text(delta=True, debounce_by=None)]
    assert "".join(deltas) == HELLO, deltas
    assert len(deltas) > 1, deltas
    return {"deltas": len(deltas)}


def with_tool(agent: Agent[Any, Any], log: ToolLog) -> None:
    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return log.get_weather(city)


def check_loop(messages: list[Any], log: ToolLog) -> None:
    log.check()
    parts = [p for m in messages for p in m.parts]
    calls = [p for p in parts if isinstance(p, ToolCallPart) and p.tool_name == "get_weather"]
    returns = [p for p in parts if isinstance(p, ToolReturnPart)
               and p.tool_name == "get_weather"]
    assert [c.args_as_dict() for c in calls] == [{"city": "Paris"}], calls
    assert [r.tool_call_id for r in returns] == [calls[0].tool_call_id], returns


async def tool_loop(base_url: str, api: str) -> dict[str, Any]:
    log = ToolLog()
    agent = Agent(model(base_url, api), model_settings=GREEDY)
    with_tool(agent, log)
    out = await agent.run(say(HERMES_CALL))
    check_loop(out.all_messages(), log)
    assert out.output == FINAL, out.output
    return {"calls": log.calls, "output": out.output}


async def structured(base_url: str, api: str) -> dict[str, Any]:
    got = {}
    kinds: list[tuple[str, Any, str]] = [("native", NativeOutput(Weather), WEATHER_JSON),
                                         ("tool", ToolOutput(Weather), OUTPUT_CALL),
                                         ("prompted", PromptedOutput(Weather), WEATHER_JSON)]
    for name, output_type, script in kinds:
        agent = Agent(model(base_url, api), model_settings=GREEDY, output_type=output_type)
        out = await agent.run(say(script))
        assert out.output == PARIS, (name, out.output)
        got[name] = out.output.model_dump()
    return got


async def structured_with_tools(base_url: str, api: str) -> dict[str, Any]:
    log = ToolLog(answer=WEATHER_JSON)
    agent = Agent(model(base_url, api), model_settings=GREEDY, output_type=NativeOutput(Weather))
    with_tool(agent, log)
    out = await agent.run(say(HERMES_CALL))
    check_loop(out.all_messages(), log)
    assert out.output == PARIS, out.output
    return {"calls": log.calls, "output": out.output.model_dump()}


if __name__ == "__main__":
    run_per_api({"plain": plain, "streamed": streamed, "tool_loop": tool_loop,
                 "structured": structured, "structured_with_tools": structured_with_tools})
