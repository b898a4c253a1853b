"""LiteLLM's `completion` through its OpenAI-compatible provider (`openai/stub` at nanoserve's
base URL): plain, streamed, a tool loop (tool_choice "required" on the first turn, the
tool run here, its result sent back), `response_format` as a pydantic model, and the
response format beside tools."""

from __future__ import annotations

import json
from typing import Any

import litellm
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


def complete(base_url: str, messages: list[Any], **kw: Any) -> Any:
    return litellm.completion(model=f"openai/{MODEL}", api_base=base_url, api_key="unused",
                              messages=messages, temperature=0, num_retries=0, timeout=60, **kw)


def plain(base_url: str) -> dict[str, Any]:
    out = complete(base_url, [{"role": "user", "content": say(HELLO)}])
    assert out.choices[0].message.content == HELLO, out
    return {"content": out.choices[0].message.content}


async def streamed(base_url: str) -> dict[str, Any]:
    stream = await litellm.acompletion(
        model=f"openai/{MODEL}", api_base=base_url, api_key="unused", temperature=0,
        messages=[{"role": "user", "content": say(HELLO)}], stream=True)
    deltas = [c.choices[0].delta.content async for c in stream
              if c.choices and c.choices[0].delta.content]
    assert "".join(deltas) == HELLO, deltas
    assert len(deltas) > 1, deltas
    return {"deltas": len(deltas)}


def loop(base_url: str, log: ToolLog, user: str, **kw: Any) -> Any:
    messages: list[Any] = [{"role": "user", "content": user}]
    first = complete(base_url, messages, tools=[WEATHER_TOOL], tool_choice="required", **kw)
    msg = first.choices[0].message
    assert msg.tool_calls, first
    messages.append(msg.model_dump(exclude_none=True))
    for call in msg.tool_calls:
        assert call.function.name == "get_weather", call
        messages.append({"role": "tool", "tool_call_id": call.id,
                         "content": log.get_weather(**json.loads(call.function.arguments))})
    log.check()
    return complete(base_url, messages, tools=[WEATHER_TOOL], **kw).choices[0].message


def tool_loop(base_url: str) -> dict[str, Any]:
    log = ToolLog()
    final = loop(base_url, log, say(REQUIRED_CALL))
    assert final.content == FINAL, final
    assert not final.tool_calls, final
    return {"calls": log.calls, "final": final.content}


def structured(base_url: str) -> dict[str, Any]:
    out = complete(base_url, [{"role": "user", "content": say(WEATHER_JSON)}],
                   response_format=Weather)
    got = Weather.model_validate_json(out.choices[0].message.content)
    assert got == PARIS, got
    return {"final": got.model_dump()}


def structured_with_tools(base_url: str) -> dict[str, Any]:
    log = ToolLog(answer=WEATHER_JSON)
    final = loop(base_url, log, say(REQUIRED_CALL), response_format=Weather)
    got = Weather.model_validate_json(final.content)
    assert got == PARIS, got
    return {"calls": log.calls, "final": got.model_dump()}


if __name__ == "__main__":
    run({"plain": plain, "streamed": streamed, "tool_loop": tool_loop,
         "structured": structured, "structured_with_tools": structured_with_tools})
