"""Tool calling with no flags (issue 42, item 2): `serve`'s default settings for the embedded
SmolLM2 (and the stub, which speaks its tokenizer) give a template that renders tools, the
hermes parser and "auto"; vLLM's flags still override. On a real socket with the official
`openai` client, the server configured exactly as `serve --model stub` configures it."""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import trio
from support.http_harness import hypercorn_on_loopback
from support.server_harness import make_engine

from nanoserve import flags
from nanoserve.bridge.clock import LiveClock
from nanoserve.server import checks, counter_ids, create_app
from nanoserve.server.main import add_args, server_config

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def serve_flags(*argv: str) -> argparse.Namespace:
    p = flags.Parser(prog="nanoserve serve")
    add_args(p)
    return p.parse_args(list(argv))


def say(text: str) -> str:
    return f"⟪say⟫{text}⟪/say⟫"


@pytest.fixture
async def default_server(request: pytest.FixtureRequest) -> AsyncIterator[openai.OpenAI]:
    argv = getattr(request, "param", ("--model", "stub"))
    app = create_app(make_engine(), server_config(serve_flags(*argv)), clock=LiveClock(),
                     id_source=counter_ids(), time_source=lambda: 1_700_000_000.0)
    async with hypercorn_on_loopback(app) as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                           timeout=60) as cl:
            yield cl


async def create(cl: openai.OpenAI, script: str, **kw: Any) -> Any:
    body = {"model": "stub", "messages": [{"role": "user", "content": say(script)}],
            "max_tokens": 80, "temperature": 0, "tools": [WEATHER], **kw}
    return (await trio.to_thread.run_sync(
        lambda: cl.chat.completions.create(**body))).choices[0]


def calls(choice: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls or []]


PARIS = [("get_weather", {"city": "Paris"})]


async def test_auto_required_and_named_work_with_no_flags(default_server: openai.OpenAI
                                                          ) -> None:
    cl = default_server
    assert calls(await create(cl, CALL)) == PARIS  # auto: tool_choice absent
    assert calls(await create(cl, CALL, tool_choice="auto")) == PARIS
    text = await create(cl, "No call needed.", tool_choice="auto")
    assert (text.message.content, text.message.tool_calls) == ("No call needed.", None)
    array = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    assert calls(await create(cl, array, tool_choice="required")) == PARIS
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert calls(await create(cl, '{"city": "Paris"}', tool_choice=named)) == PARIS


@pytest.mark.parametrize("default_server", [("--model", "stub",
                                             "--no-enable-auto-tool-choice")], indirect=True)
async def test_vllms_rule_comes_back_with_its_flag_off(default_server: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await create(default_server, CALL)
    assert info.value.body["param"] == "tool_choice"  # type: ignore[index]
    assert info.value.body["message"].endswith(  # type: ignore[index]
        "started with --enable-auto-tool-choice")  # the parser is known: hermes, ChatML
    array = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    assert calls(await create(default_server, array, tool_choice="required")) == PARIS


def test_the_defaults_per_model_and_the_flags_that_override_them() -> None:
    stub = server_config(serve_flags("--model", "stub"))
    assert stub.chat_template == checks.chat_template("smollm2-tools")
    assert stub.agents.enable_auto_tool_choice
    assert server_config(serve_flags()).chat_template == stub.chat_template  # smollm2
    # Gemma 3 270M is a base model without a template: none is made up for it.
    assert server_config(serve_flags("--model", "gemma3-270m")).chat_template is None
    given = server_config(serve_flags("--model", "stub", "--chat-template", "chatml-tools",
                                      "--tool-call-parser", "mistral"))
    assert given.chat_template == checks.chat_template("chatml-tools")
    assert given.agents.tool_call_parser == "mistral"
    assert server_config(serve_flags("--enable-auto-tool-choice")).agents.enable_auto_tool_choice
