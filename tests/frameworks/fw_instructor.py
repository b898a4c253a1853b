"""Instructor (its own interpreter, .venv/instructor: instructor 1.16 needs openai<3, and
nanoserve pins openai 3): a plain completion (`response_model=None`), a streamed partial
model, structured output in the modes that reach a server differently (TOOLS: a named
tool_choice; JSON_SCHEMA: `response_format`; JSON: the prompt and a JSON object), and
RESPONSES_TOOLS: the model as a forced function tool on the Responses API. Instructor runs
no tools of its own, so it has no tool loop."""

from __future__ import annotations

from typing import Any

import instructor
import openai
from common import HELLO, MODEL, PARIS, WEATHER_JSON, Weather, run, say


def client(base_url: str, mode: instructor.Mode) -> Any:
    raw = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    return instructor.from_openai(raw, mode=mode)


def plain(base_url: str) -> dict[str, Any]:
    out = client(base_url, instructor.Mode.TOOLS).create(
        model=MODEL, temperature=0, response_model=None,
        messages=[{"role": "user", "content": say(HELLO)}])
    assert out.choices[0].message.content == HELLO, out
    return {"content": out.choices[0].message.content}


def streamed(base_url: str) -> dict[str, Any]:
    partials = list(client(base_url, instructor.Mode.TOOLS).create_partial(
        model=MODEL, temperature=0, response_model=Weather, max_retries=0,
        messages=[{"role": "user", "content": say(WEATHER_JSON)}]))
    assert len(partials) > 1, partials
    assert partials[-1].model_dump() == PARIS.model_dump(), partials[-1]
    return {"partials": len(partials)}


def structured(base_url: str) -> dict[str, Any]:
    got = {}
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA, instructor.Mode.JSON):
        out = client(base_url, mode).create(
            model=MODEL, temperature=0, response_model=Weather, max_retries=0,
            messages=[{"role": "user", "content": say(WEATHER_JSON)}])
        assert out.model_dump() == PARIS.model_dump(), (mode, out)
        got[mode.name] = out.model_dump()
    return got


def structured_with_tools(base_url: str) -> dict[str, Any]:
    out = client(base_url, instructor.Mode.RESPONSES_TOOLS).create(
        model=MODEL, temperature=0, response_model=Weather, max_retries=0,
        messages=[{"role": "user", "content": say(WEATHER_JSON)}])
    assert out.model_dump() == PARIS.model_dump(), out
    return {"output": out.model_dump()}


if __name__ == "__main__":
    run({"plain": plain, "streamed": streamed, "structured": structured,
         "structured_with_tools": structured_with_tools})
