"""The official `openai` client (nanoserve's own pin, 3.51.0): chat plain and streamed, a tool
loop under tool_choice "required", `chat.completions.parse` and `responses.parse` into a
pydantic model, and parse with a strict tool beside the response format."""

from __future__ import annotations

import json
from typing import Any

import openai
from common import (
    FINAL,
    HELLO,
    MODEL,
    PARIS,
    REQUIRED_CALL,
    WEATHER_JSON,
    WEATHER_TOOL,
    ToolLog,
    Weather,
    run,
    say,
)
from pydantic import BaseModel, ConfigDict


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)


def plain(base_url: str) -> dict[str, Any]:
    out = client(base_url).chat.completions.create(
        model=MODEL, temperature=0, messages=[{"role": "user", "content": say(HELLO)}])
    assert out.choices[0].message.content == HELLO, out
    return {"content": out.choices[0].message.content}


def streamed(base_url: str) -> dict[str, Any]:
    chunks = list(client(base_url).chat.completions.create(
        model=MODEL, temperature=0, messages=[{"role": "user", "content": say(HELLO)}],
        stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == HELLO, text
    assert len(chunks) > 2, chunks
    return {"chunks": len(chunks)}


def tool_loop(base_url: str) -> dict[str, Any]:
    cl, tool = client(base_url), ToolLog()
    messages: list[Any] = [{"role": "user", "content": say(REQUIRED_CALL)}]
    first = cl.chat.completions.create(model=MODEL, temperature=0, messages=messages,
                                       tools=[WEATHER_TOOL], tool_choice="required").choices[0]
    assert first.finish_reason == "tool_calls", first
    messages.append(first.message.model_dump(exclude_none=True))
    for call in first.message.tool_calls or []:
        result = tool.get_weather(**json.loads(call.function.arguments))  # type: ignore[union-attr]
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    tool.check()
    final = cl.chat.completions.create(model=MODEL, temperature=0, messages=messages,
                                       tools=[WEATHER_TOOL]).choices[0]
    assert final.message.content == FINAL, final
    assert not final.message.tool_calls, final
    return {"calls": tool.calls, "final": final.message.content}


def structured(base_url: str) -> dict[str, Any]:
    cl = client(base_url)
    chat = cl.chat.completions.parse(model=MODEL, temperature=0, response_format=Weather, messages=[
        {"role": "user", "content": say(WEATHER_JSON)}]).choices[0].message.parsed
    assert chat == PARIS, chat
    resp = cl.responses.parse(model=MODEL, temperature=0, input=say(WEATHER_JSON),
                              text_format=Weather)
    assert resp.output_parsed == PARIS, resp
    return {"chat": chat.model_dump(), "responses": resp.output_parsed.model_dump()}


def structured_with_tools(base_url: str) -> dict[str, Any]:
    cl, tool = client(base_url), ToolLog(answer=WEATHER_JSON)
    tools: Any = [openai.pydantic_function_tool(GetWeather, name="get_weather")]
    messages: list[Any] = [{"role": "user", "content": say(REQUIRED_CALL)}]
    first = cl.chat.completions.parse(model=MODEL, temperature=0, messages=messages, tools=tools,
                                      tool_choice="required", response_format=Weather)
    msg = first.choices[0].message
    assert msg.tool_calls, first
    messages.append(msg.model_dump(exclude_none=True, exclude={"parsed"}))
    for call in msg.tool_calls:
        args = call.function.parsed_arguments
        assert isinstance(args, GetWeather), args
        messages.append({"role": "tool", "tool_call_id": call.id,
                         "content": tool.get_weather(args.city)})
    tool.check()
    final = cl.chat.completions.parse(model=MODEL, temperature=0, messages=messages, tools=tools,
                                      response_format=Weather).choices[0].message
    assert final.parsed == PARIS, final
    return {"calls": tool.calls, "final": final.parsed.model_dump()}


class GetWeather(BaseModel):
    """The weather in a city."""

    model_config = ConfigDict(extra="forbid")
    city: str


if __name__ == "__main__":
    run({"plain": plain, "streamed": streamed, "tool_loop": tool_loop,
         "structured": structured, "structured_with_tools": structured_with_tools})
