"""What every framework's script shares: the stub's scripts, the tool, the output schema, and
the runner that runs each case and prints one JSON line per case for the pytest side
(tests/server/test_frameworks.py). Standard library and pydantic only: it is imported by the
frameworks' own interpreters (.venv/agents, .venv/instructor), not by nanoserve's.

The stub says what a prompt scripts (`⟪say⟫TEXT⟪/say⟫`, the last one in the prompt), so each
turn's output is known: the user's message scripts a call (or the structured answer), the
tool's result scripts the final answer. A forced call (tool_choice required or named) is
generated from the tools' grammar, and the script is written in the shape that grammar takes.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import sys
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ConfigDict

MODEL = "stub"
# Every request asks for greedy decoding: the stub's script is its top token, and `serve`
# samples at temperature 1 by default.
HELLO = "Hello from the stub."
FINAL = "It is sunny in Paris."


def say(text: str) -> str:
    return f"⟪say⟫{text}⟪/say⟫"


class Weather(BaseModel):
    """The structured answer."""

    model_config = ConfigDict(extra="forbid")
    city: str
    temperature_c: int


WEATHER_JSON = '{"city": "Paris", "temperature_c": 21}'
PARIS = Weather(city="Paris", temperature_c=21)
# The model's call, in each form the server's grammar or parser takes it.
ARGS = '{"city": "Paris"}'
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
REQUIRED_CALL = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
WEATHER_TOOL: Any = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}


class ToolLog:
    """get_weather, as every framework runs it: it records its calls, and its result scripts
    the model's next turn (the final answer, text or `answer`)."""

    def __init__(self, answer: str = FINAL) -> None:
        self.calls: list[dict[str, Any]] = []
        self.answer = answer

    def get_weather(self, city: str) -> str:
        self.calls.append({"city": city})
        return f"Sunny, 21 C. {say(self.answer)}"

    def check(self) -> None:
        assert self.calls == [{"city": "Paris"}], self.calls


Case = Callable[[str], Awaitable[dict[str, Any]] | dict[str, Any]]


def run(cases: dict[str, Case]) -> None:
    """`python SCRIPT BASE_URL [CASE...]`: each case against the server at BASE_URL (…/v1),
    one JSON line each on stdout: {"case", "ok", "detail" or "error"}. All in one
    event loop, so async clients outlive no loop of theirs."""
    asyncio.run(_run(cases, sys.argv[1], sys.argv[2:] or list(cases)))


async def _run(cases: dict[str, Case], base_url: str, wanted: list[str]) -> None:
    for name in wanted:
        try:
            got = cases[name](base_url)
            if inspect.isawaitable(got):
                got = await got
            line = {"case": name, "ok": True, "detail": got}
        except Exception as e:  # every failure is reported, not raised
            line = {"case": name, "ok": False, "error": f"{type(e).__name__}: {e}"[:2000],
                    "traceback": traceback.format_exc()[-4000:]}
        print(json.dumps(line, default=str), flush=True)


def run_per_api(cases: dict[str, Callable[[str, str], Any]]) -> None:
    """`run`, each case once through the framework's Chat Completions model and once through
    its Responses model: case(base_url, api), named "case[api]"."""

    def on(api: str, case: Callable[[str, str], Any]) -> Case:
        return lambda base_url: case(base_url, api)

    run({f"{name}[{api}]": on(api, case) for api in ("chat", "responses")
         for name, case in cases.items()})
