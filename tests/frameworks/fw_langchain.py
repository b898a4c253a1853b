"""langchain-openai's ChatOpenAI with LangGraph: invoke, stream, a LangGraph ReAct agent's
tool loop (the graph's ToolNode runs the tool and loops back to the model),
`with_structured_output` (json_schema, the default, and function calling), and the agent
with tools and a `response_format`."""

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
    run,
    say,
)
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import StructuredTool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent


def chat(base_url: str) -> ChatOpenAI:
    return ChatOpenAI(model=MODEL, base_url=base_url, api_key="unused",  # type: ignore[arg-type]
                      temperature=0, max_retries=0, timeout=60)


def plain(base_url: str) -> dict[str, Any]:
    out = chat(base_url).invoke(say(HELLO))
    assert out.content == HELLO, out
    return {"content": out.content}


def streamed(base_url: str) -> dict[str, Any]:
    chunks = [c.content for c in chat(base_url).stream(say(HELLO))]
    assert "".join(str(c) for c in chunks) == HELLO, chunks
    assert len([c for c in chunks if c]) > 1, chunks
    return {"chunks": len(chunks)}


def weather_tool(log: ToolLog) -> StructuredTool:
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return log.get_weather(city)
    return StructuredTool.from_function(get_weather)


def check_loop(messages: list[Any], log: ToolLog) -> list[str]:
    log.check()
    kinds = [type(m).__name__ for m in messages]
    assert kinds == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"], kinds
    call, result = messages[1], messages[2]
    assert isinstance(call, AIMessage), call
    assert [(c["name"], c["args"]) for c in call.tool_calls] == [
        ("get_weather", {"city": "Paris"})], call.tool_calls
    assert isinstance(result, ToolMessage), result
    assert result.tool_call_id == call.tool_calls[0]["id"], result
    return kinds


def tool_loop(base_url: str) -> dict[str, Any]:
    # The graph binds the tools once for every turn, so tool_choice stays "auto" here (a
    # forced choice would force every turn): the stub's script makes the call.
    log = ToolLog()
    agent = create_react_agent(chat(base_url), [weather_tool(log)])
    state = agent.invoke({"messages": [("user", say(HERMES_CALL))]})
    kinds = check_loop(state["messages"], log)
    assert state["messages"][-1].content == FINAL, state["messages"][-1]
    return {"calls": log.calls, "messages": kinds}


def structured(base_url: str) -> dict[str, Any]:
    got = {}
    for method in ("json_schema", "function_calling"):
        out = chat(base_url).with_structured_output(Weather, method=method).invoke(
            say(WEATHER_JSON))
        assert out == PARIS, (method, out)
        got[method] = out.model_dump()
    return got


def structured_with_tools(base_url: str) -> dict[str, Any]:
    log = ToolLog(answer=WEATHER_JSON)
    agent = create_react_agent(chat(base_url), [weather_tool(log)], response_format=Weather)
    state = agent.invoke({"messages": [("user", say(HERMES_CALL))]})
    check_loop(state["messages"], log)
    assert state["structured_response"] == PARIS, state["structured_response"]
    # And ChatOpenAI's own composition: tools and a response format on one request.
    bound = chat(base_url).bind_tools([weather_tool(log)], response_format=Weather,
                                      strict=True, tool_choice="get_weather")
    call = bound.invoke(say('{"city": "Paris"}'))
    assert [(c["name"], c["args"]) for c in call.tool_calls] == [
        ("get_weather", {"city": "Paris"})], call
    return {"calls": log.calls, "final": state["structured_response"].model_dump()}


if __name__ == "__main__":
    run({"plain": plain, "streamed": streamed, "tool_loop": tool_loop,
         "structured": structured, "structured_with_tools": structured_with_tools})
