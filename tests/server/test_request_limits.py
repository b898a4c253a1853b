"""The size limits a request meets before the work they bound (server/body/limits.py): each is
a 400 whose `param` names the field and whose message names the limit, and the server
serves on. The defaults come from RequestLimits (server/settings.py): OpenAI's 128 tools, and
characters at CHARS_PER_TOKEN times the model's context."""

from __future__ import annotations

from typing import Any

from support.http_harness import serving
from support.server_harness import assert_error, assert_serving, make_app, make_engine

from nanoserve.server.settings import CHARS_PER_TOKEN, RequestLimits

CTX = 64  # max_model_len: the character limits are CHARS_PER_TOKEN times this
CHAT = {"model": "stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def tools(n: int) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {}}}} for i in range(n)]


async def refused(path: str, body: dict[str, Any], param: str, limit: str,
                  **cfg: Any) -> dict[str, Any]:
    async with serving(make_app(make_engine(max_model_len=CTX), **cfg)) as h:
        err = assert_error(await h.post(path, body), 400, param)
        await assert_serving(h)
    assert limit in err["message"], err
    return err


async def test_more_tools_than_the_limit_is_a_400_naming_tools() -> None:
    body = {**CHAT, "tools": tools(129), "tool_choice": "none"}
    err = await refused("/v1/chat/completions", body, "tools", "max_tools")
    assert err["code"] == "too_many_tools"
    assert "129 entries" in err["message"]
    assert "limit of 128" in err["message"]


async def test_the_tools_limit_holds_on_the_responses_route_too() -> None:
    body = {"model": "stub", "input": "hi", "max_output_tokens": 2, "tool_choice": "none",
            "tools": [{"type": "function", "name": f"f{i}", "parameters": {}}
                      for i in range(3)]}
    await refused("/v1/responses", body, "tools", "max_tools",
                  limits=RequestLimits(max_tools=2))


async def test_a_completion_prompt_over_the_characters_limit_is_a_400() -> None:
    long = "x" * (CHARS_PER_TOKEN * CTX + 1)
    body = {"model": "stub", "prompt": long, "max_tokens": 2}
    err = await refused("/v1/completions", body, "prompt", "max_prompt_chars")
    assert err["code"] == "prompt_too_long"
    await refused("/v1/completions", {**body, "prompt": ["ok", long]}, "prompt[1]",
                  "max_prompt_chars")


async def test_chat_messages_over_the_characters_limit_are_a_400_before_the_template(
) -> None:
    half = "y" * (CHARS_PER_TOKEN * CTX // 2 + 1)  # each fits, the two together do not
    body = {**CHAT, "messages": [{"role": "user", "content": half},
                                 {"role": "assistant", "content": [{"type": "text",
                                                                    "text": half}]},
                                 {"role": "user", "content": "hi"}]}
    await refused("/v1/chat/completions", body, "messages", "max_prompt_chars")


async def test_a_template_output_over_its_limit_is_a_400_naming_messages() -> None:
    # "hi" is two characters, its template's output more than 20.
    err = await refused("/v1/chat/completions", CHAT, "messages", "max_template_chars",
                        limits=RequestLimits(max_template_chars=20))
    assert "chat template" in err["message"]


async def test_limits_at_their_bound_pass() -> None:
    exact = "x" * (CHARS_PER_TOKEN * CTX)  # the character limit itself is allowed...
    async with serving(make_app(make_engine(max_model_len=CTX))) as h:
        r = await h.post("/v1/completions", {"model": "stub", "prompt": exact, "max_tokens": 2})
        # ...and reaches the tokenizer, whose count decides whether it fits the context
        assert r.status == 200 or "max_prompt_chars" not in r.json()["error"]["message"]
        body = {**CHAT, "tools": tools(128), "tool_choice": "none"}
        r = await h.post("/v1/chat/completions", body)
        assert r.status == 200, r.body
