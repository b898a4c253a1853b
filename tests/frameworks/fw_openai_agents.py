"""openai-agents: an Agent on nanoserve through both of its OpenAI models (Chat Completions
and Responses): a plain run, a streamed run, a tool loop under tool_choice "required" (the
SDK resets it after the call, so the next turn answers), `output_type`, and `output_type`
with tools."""

from __future__ import annotations

from typing import Any

from agents import (
    Agent,
    AsyncOpenAI,
    Model,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from common import (
    FINAL,
    HELLO,
    MODEL,
    PARIS,
    REQUIRED_CALL,
    WEATHER_JSON,
    ToolLog,
    Weather,
    run_per_api,
    say,
)
from openai.types.responses import ResponseTextDeltaEvent

set_tracing_disabled(True)
GREEDY = ModelSettings(temperature=0)
FORCED = ModelSettings(temperature=0, tool_choice="required")


def model(base_url: str, api: str) -> Model:
    cl = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    if api == "chat":
        return OpenAIChatCompletionsModel(model=MODEL, openai_client=cl)
    return OpenAIResponsesModel(model=MODEL, openai_client=cl)


async def plain(base_url: str, api: str) -> dict[str, Any]:
    agent = Agent(name="plain", model=model(base_url, api), model_settings=GREEDY)
    out = await Runner.run(agent, say(HELLO))
    assert out.final_output == HELLO, out.final_output
    return {"final": out.final_output}


async def streamed(base_url: str, api: str) -> dict[str, Any]:
    agent = Agent(name="streamed", model=model(base_url, api), model_settings=GREEDY)
    result = Runner.run_streamed(agent, say(HELLO))
    deltas = [e.data.delta async for e in result.stream_events()
              if e.type == "raw_response_event" and isinstance(e.data, ResponseTextDeltaEvent)]
    assert "".join(deltas) == HELLO, deltas
    assert len(deltas) > 1, deltas
    assert result.final_output == HELLO, result.final_output
    return {"deltas": len(deltas)}


def weather_tool(log: ToolLog) -> Any:
    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return log.get_weather(city)
    return get_weather


async def tool_loop(base_url: str, api: str) -> dict[str, Any]:
    log = ToolLog()
    agent = Agent(name="tools", model=model(base_url, api), model_settings=FORCED,
                  tools=[weather_tool(log)])
    out = await Runner.run(agent, say(REQUIRED_CALL), max_turns=4)
    log.check()
    assert out.final_output == FINAL, out.final_output
    kinds = [item.type for item in out.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds
    return {"calls": log.calls, "items": kinds}


async def structured(base_url: str, api: str) -> dict[str, Any]:
    agent = Agent(name="structured", model=model(base_url, api), model_settings=GREEDY,
                  output_type=Weather)
    out = await Runner.run(agent, say(WEATHER_JSON))
    assert out.final_output == PARIS, out.final_output
    return {"final": out.final_output.model_dump()}


async def structured_with_tools(base_url: str, api: str) -> dict[str, Any]:
    log = ToolLog(answer=WEATHER_JSON)
    agent = Agent(name="both", model=model(base_url, api), model_settings=FORCED,
                  tools=[weather_tool(log)], output_type=Weather)
    out = await Runner.run(agent, say(REQUIRED_CALL), max_turns=4)
    log.check()
    assert out.final_output == PARIS, out.final_output
    return {"calls": log.calls, "final": out.final_output.model_dump()}


if __name__ == "__main__":
    run_per_api({"plain": plain, "streamed": streamed, "tool_loop": tool_loop,
                 "structured": structured, "structured_with_tools": structured_with_tools})
