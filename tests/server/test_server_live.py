"""A real Hypercorn server on 127.0.0.1 (in-process), driven by the official `openai` client.

For every case the joined stream equals the unary response with the same seed (text, token
logprobs, finish reasons) and usage is exact: streaming is a delivery schedule, not a
different model. The client is the synchronous one, run in a worker thread, so the server's
Trio loop is the only event loop. The last tests hang up a raw socket mid-stream on the
gate clock and count steps, and run two cases on SmolLM2's real weights (`-m real`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

import openai
import pytest
import trio
import trio.testing
from support.http_harness import stub_parts
from support.server_harness import live, make_engine

from nanoserve.bridge.clock import GateClock
from nanoserve.config import EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.server import server_state
from nanoserve.tokenizer import Tokenizer

PROMPT = "def step(self):"
PERSON_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"], "additionalProperties": False}


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


async def in_thread(fn: Callable[[], Any]) -> Any:
    return await trio.to_thread.run_sync(fn)


def join_completion_stream(chunks: list[Any]) -> tuple[list[dict[str, Any]], Any]:
    """Choices as a unary response would have them, and the usage chunk's usage."""
    by_index: dict[int, dict[str, Any]] = {}
    usage = None
    for chunk in chunks:
        if chunk.usage is not None:
            assert chunk.choices == []  # the usage chunk stands alone, last
            usage = chunk.usage
        for c in chunk.choices:
            acc = by_index.setdefault(c.index, {"text": "", "finish_reason": None, "lp": None})
            assert acc["finish_reason"] is None, "a chunk after the choice's finish"
            acc["text"] += c.text
            acc["finish_reason"] = c.finish_reason
            if c.logprobs is not None:
                lp = acc["lp"] or {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                   "text_offset": []}
                for k in lp:
                    lp[k] += getattr(c.logprobs, k)
                acc["lp"] = lp
    return [by_index[i] for i in sorted(by_index)], usage


def unary_choices(resp: Any) -> list[dict[str, Any]]:
    out = []
    for c in resp.choices:
        lp = None if c.logprobs is None else {
            k: getattr(c.logprobs, k)
            for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        out.append({"text": c.text, "finish_reason": c.finish_reason, "lp": lp})
    return out


async def check_completion(
    cl: openai.OpenAI, tok: Tokenizer, model: str = "stub", **kw: Any
) -> Any:
    unary = await in_thread(lambda: cl.completions.create(model=model, **kw))
    chunks = await in_thread(lambda: list(cl.completions.create(
        model=model, stream=True, stream_options={"include_usage": True}, **kw)))
    joined, usage = join_completion_stream(chunks)
    assert joined == unary_choices(unary)
    assert usage == unary.usage
    prompts = kw["prompt"] if isinstance(kw["prompt"], list) else [kw["prompt"]]
    if prompts and isinstance(prompts[0], int):
        prompts = [prompts]
    n = kw.get("n", 1)
    expect_prompt = sum(len(p) if isinstance(p, list) else len(tok.encode(p)) for p in prompts)
    assert unary.usage.prompt_tokens == expect_prompt
    for c in unary.choices:
        if c.logprobs is not None:  # each token has one logprobs entry: count them
            assert len(c.logprobs.tokens) <= kw["max_tokens"]
    if all(c.finish_reason == "length" for c in unary.choices):
        assert unary.usage.completion_tokens == kw["max_tokens"] * n * len(prompts)
    assert unary.usage.total_tokens == unary.usage.prompt_tokens + unary.usage.completion_tokens
    return unary


@pytest.fixture
async def stub_server() -> AsyncIterator[tuple[openai.OpenAI, Tokenizer]]:
    async with live(make_engine()) as (url, _):
        # Closed before the server stops: Hypercorn waits out its graceful_timeout for idle
        # keep-alive connections rather than closing them.
        with client(url) as cl:
            yield cl, stub_parts()[1]


COMPLETION_CASES = [
    pytest.param({"prompt": PROMPT, "max_tokens": 12, "seed": 7}, id="plain"),
    pytest.param({"prompt": PROMPT, "max_tokens": 8, "seed": 3, "logprobs": 3}, id="logprobs"),
    pytest.param({"prompt": [1, 700, 3300, 28], "max_tokens": 8, "seed": 5}, id="token-ids"),
    pytest.param({"prompt": [PROMPT, "The quick"], "max_tokens": 5, "seed": 1},
                 id="two-prompts"),
    pytest.param({"prompt": PROMPT, "max_tokens": 6, "seed": 11, "n": 2, "logprobs": 1},
                 id="n=2"),
    pytest.param({"prompt": PROMPT, "max_tokens": 6, "seed": 2,
                  "extra_body": {"top_k": 3, "min_p": 0.01, "repetition_penalty": 1.1,
                                 "ignore_eos": True}}, id="vllm-extras"),
    pytest.param({"prompt": PROMPT, "max_tokens": 30, "seed": 4, "temperature": 0.8,
                  "extra_body": {"guided_json": PERSON_SCHEMA}}, id="guided-json"),
    pytest.param({"prompt": PROMPT, "max_tokens": 6, "seed": 8, "n": 3,
                  "extra_body": {"guided_choice": ["red", "green", "blue"]}},
                 id="guided-choice"),
]


@pytest.mark.parametrize("kw", COMPLETION_CASES)
async def test_completion_stream_equals_unary(
    stub_server: tuple[openai.OpenAI, Tokenizer], kw: dict[str, Any]
) -> None:
    cl, tok = stub_server
    await check_completion(cl, tok, **kw)


async def test_completion_stop_string(stub_server: tuple[openai.OpenAI, Tokenizer]) -> None:
    await check_stop_string(*stub_server, "stub")


async def check_stop_string(cl: openai.OpenAI, tok: Tokenizer, model: str) -> None:
    base = {"prompt": PROMPT, "max_tokens": 30, "seed": 7, "logprobs": 0, "model": model}
    full = (await check_completion(cl, tok, **base)).choices[0].text
    # A stop string from the middle of the unstopped text: the output must end before it.
    words = [w for w in full.split() if w.isascii() and w.isalpha()]
    assert len(words) >= 3, full
    stop = words[len(words) // 2]
    stopped = await check_completion(cl, tok, **base, stop=[stop])
    c = stopped.choices[0]
    assert c.finish_reason == "stop"
    assert c.text == full[: full.index(stop)]
    assert stopped.usage.completion_tokens == len(c.logprobs.tokens) < 30


def join_chat_stream(chunks: list[Any]) -> tuple[list[dict[str, Any]], Any]:
    by_index: dict[int, dict[str, Any]] = {}
    usage = None
    for chunk in chunks:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            first = c.index not in by_index
            acc = by_index.setdefault(c.index, {"content": "", "finish_reason": None,
                                                "lp": None})
            assert (c.delta.role == "assistant") == first  # role on each choice's first chunk
            acc["content"] += c.delta.content or ""
            acc["finish_reason"] = c.finish_reason
            if c.logprobs is not None:
                acc["lp"] = (acc["lp"] or []) + [e.model_dump() for e in c.logprobs.content]
    return [by_index[i] for i in sorted(by_index)], usage


CHAT_CASES = [
    pytest.param({"max_tokens": 10, "seed": 3}, id="plain"),
    pytest.param({"max_completion_tokens": 8, "seed": 4, "logprobs": True, "top_logprobs": 2},
                 id="logprobs"),
    pytest.param({"max_tokens": 5, "seed": 9, "n": 2}, id="n=2"),
    pytest.param({"max_tokens": 40, "seed": 5, "temperature": 0.9, "n": 2,
                  "response_format": {"type": "json_schema", "json_schema": {
                      "name": "reply", "strict": True, "schema": PERSON_SCHEMA}}},
                 id="json-schema"),
    pytest.param({"max_tokens": 12, "seed": 6, "extra_body": {
        "guided_regex": "[a-z]{2}-[0-9]{3}"}}, id="guided-regex"),
]


@pytest.mark.parametrize("kw", CHAT_CASES)
async def test_chat_stream_equals_unary(
    stub_server: tuple[openai.OpenAI, Tokenizer], kw: dict[str, Any]
) -> None:
    await check_chat(*stub_server, "stub", **kw)


async def check_chat(cl: openai.OpenAI, tok: Tokenizer, model: str, **kw: Any) -> None:
    messages: Any = [{"role": "user", "content": "Say something."}]
    unary = await in_thread(lambda: cl.chat.completions.create(
        model=model, messages=messages, **kw))
    chunks = await in_thread(lambda: list(cl.chat.completions.create(
        model=model, messages=messages, stream=True,
        stream_options={"include_usage": True}, **kw)))
    joined, usage = join_chat_stream(chunks)
    assert unary.object == "chat.completion"
    expect = [{"content": c.message.content, "finish_reason": c.finish_reason,
               "lp": None if c.logprobs is None else [e.model_dump() for e in c.logprobs.content]}
              for c in unary.choices]
    assert joined == expect
    assert all(c.message.role == "assistant" for c in unary.choices)
    assert usage == unary.usage
    prompt = tok.apply_chat_template(messages)
    assert unary.usage.prompt_tokens == len(tok.encode(prompt))
    limit = kw.get("max_tokens") or kw["max_completion_tokens"]
    if all(c.finish_reason == "length" for c in unary.choices):
        assert unary.usage.completion_tokens == limit * kw.get("n", 1)
    if kw.get("logprobs"):
        entries = expect[0]["lp"]
        assert len(entries) == limit
        assert all(len(e["top_logprobs"]) == 2 for e in entries)
        assert all(bytes(e["bytes"]).decode("utf-8", "backslashreplace") == e["token"]
                   for e in entries)


async def test_the_openai_clients_parse_with_a_pydantic_model(
    stub_server: tuple[openai.OpenAI, Tokenizer],
) -> None:
    """`client.beta.chat.completions.parse(response_format=Model)`: the client turns the
    model into a strict json_schema, and the constrained reply parses into it."""
    from pydantic import BaseModel, Field

    class Person(BaseModel):  # bounded: the stub's noise would otherwise run to max_tokens
        name: str = Field(max_length=16)
        age: int
        tags: list[Annotated[str, Field(max_length=8)]] = Field(max_length=3)

    cl, _ = stub_server
    for seed in range(3):
        r = await in_thread(lambda seed=seed: cl.beta.chat.completions.parse(
            model="stub", messages=[{"role": "user", "content": "A person."}],
            response_format=Person, max_tokens=400, seed=seed, temperature=0.8))
        parsed = r.choices[0].message.parsed
        assert isinstance(parsed, Person)
        assert Person.model_validate_json(r.choices[0].message.content or "") == parsed


async def test_error_reaches_the_openai_client(
    stub_server: tuple[openai.OpenAI, Tokenizer],
) -> None:
    cl, _ = stub_server
    with pytest.raises(openai.BadRequestError) as info:
        await in_thread(lambda: cl.completions.create(model="stub", prompt=PROMPT,
                                                      max_tokens=4, temperature=-1))
    assert info.value.status_code == 400
    assert info.value.body["param"] == "temperature"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        await in_thread(lambda: cl.completions.create(model="gpt-9", prompt=PROMPT))
    models = await in_thread(lambda: cl.models.list())
    assert [m.id for m in models.data] == ["stub"]


async def test_socket_hangup_mid_stream_aborts_at_the_next_boundary() -> None:
    gate, engine = GateClock(), make_engine()
    async with live(engine, clock=gate) as (url, app):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        body = json.dumps({"model": "stub", "prompt": PROMPT, "max_tokens": 50,
                           "temperature": 0.0, "stream": True}).encode()
        sock = await trio.open_tcp_stream(host, int(port))
        await sock.send_all(
            b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json"
            b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        received = b""
        for frames in (1, 2):
            gate.release(1)
            while received.count(b"data: ") < frames:
                received += await sock.receive_some()
        assert received.startswith(b"HTTP/1.1 200")
        await sock.aclose()
        registry = server_state(app).ready.registry  # type: ignore[union-attr]
        with trio.fail_after(30):  # a bound, not a stopwatch: the hang-up must arrive
            await registry.wait_empty()
        gate.release(10)
        await trio.testing.wait_all_tasks_blocked()
        assert gate.steps_run == 2
        s = engine.statistics()
        assert (s.running, s.aborted, s.free_blocks) == (0, 1, s.num_blocks)


@pytest.mark.real
async def test_real_weights_stream_equals_unary(
    smollm2_model: Any, smollm2_tokenizer: Tokenizer
) -> None:
    model, tok = smollm2_model, smollm2_tokenizer
    engine = Engine(model, tok, EngineConfig(block_size=16, num_blocks=256, max_model_len=2048))
    async with live(engine, name="smollm2") as (url, _):
        with client(url) as cl:
            unary = await in_thread(lambda: cl.completions.create(
                model="smollm2", prompt="The capital of France is", max_tokens=8, temperature=0,
                logprobs=2))
            assert unary.usage.completion_tokens == 8
            assert "Paris" in unary.choices[0].text  # greedy: real weights, real answer
            chunks = await in_thread(lambda: list(cl.completions.create(
                model="smollm2", prompt="The capital of France is", max_tokens=8, temperature=0,
                logprobs=2, stream=True, stream_options={"include_usage": True})))
            joined, usage = join_completion_stream(chunks)
            assert joined == unary_choices(unary)
            assert usage == unary.usage
            messages = [{"role": "user", "content": "What is the capital of France?"}]
            kw: dict[str, Any] = {"model": "smollm2", "messages": messages, "max_tokens": 12,
                                  "seed": 1, "temperature": 0.7}
            chat = await in_thread(lambda: cl.chat.completions.create(**kw))
            chat_chunks = await in_thread(lambda: list(cl.chat.completions.create(
                **kw, stream=True, stream_options={"include_usage": True})))
            joined_chat, chat_usage = join_chat_stream(chat_chunks)
            assert joined_chat[0]["content"] == chat.choices[0].message.content
            assert chat_usage == chat.usage
            assert chat.usage.prompt_tokens == len(tok.encode(tok.apply_chat_template(messages)))
            # The stub's cases, unchanged, on the real weights: n=2, token-id prompts, vLLM's
            # extras, logprobs and a stop string drawn from the model's own unstopped text.
            for case in COMPLETION_CASES:
                await check_completion(cl, tok, "smollm2", **case.values[0])
            for case in CHAT_CASES:
                await check_chat(cl, tok, "smollm2", **case.values[0])
            await check_stop_string(cl, tok, "smollm2")
