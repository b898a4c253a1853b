"""vLLM's `return_token_ids`, and `echo` of a prompt that holds special tokens, on the stub
model: exact ids and exact text, unary and streamed, the stream adding up to the unary."""

from __future__ import annotations

import json
from typing import Any

from support.http_harness import serving, stub_parts
from support.server_harness import make_app

from nanoserve.config import EngineConfig
from nanoserve.llm import LLM
from nanoserve.sampling.params import SamplingParams

EOT = "<|endoftext|>"  # token 0, a special token of SmolLM2's vocabulary


def chunks_of(r: Any) -> list[dict[str, Any]]:
    assert r.status == 200, r.body
    events = r.events()
    assert events[-1] == "[DONE]"
    return [json.loads(ev) for ev in events[:-1]]


def by_choice(chunks: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for ch in chunks:
        for c in ch["choices"]:
            out.setdefault(c["index"], []).append(c)
    return out


def engine_tokens(prompts: list[Any], params: SamplingParams) -> list[list[int]]:
    """What LLM.generate samples for these prompts: one list per completion, in order."""
    model, tok = stub_parts()
    llm = LLM.from_parts(model, tok, EngineConfig(block_size=16, num_blocks=128,
                                                  max_model_len=1024))
    return [list(o.token_ids) for out in llm.generate(prompts, params, use_tqdm=False)
            for o in out.outputs]


async def test_return_token_ids_on_completions_unary_and_streamed() -> None:
    prompts: list[Any] = ["def step(self):", "def step"]
    want = engine_tokens(prompts, SamplingParams(n=2, seed=3, temperature=0.8, max_tokens=4,
                                                 ignore_eos=True))
    body = {"model": "stub", "prompt": prompts, "n": 2, "seed": 3, "temperature": 0.8,
            "max_tokens": 4, "ignore_eos": True, "return_token_ids": True}
    prompt_ids = [[1604, 1833, 24, 771, 727]] * 2 + [[1604, 1833]] * 2
    async with serving(make_app()) as h:
        choices = (await h.post("/v1/completions", body)).json()["choices"]
        assert [c["prompt_token_ids"] for c in choices] == prompt_ids
        assert [c["token_ids"] for c in choices] == want
        streamed = by_choice(chunks_of(await h.post("/v1/completions",
                                                    {**body, "stream": True})))
        for i in range(4):
            cs = streamed[i]
            # As vLLM: the prompt's ids on the first chunk (null after), each chunk's own ids.
            assert [c["prompt_token_ids"] for c in cs] == [prompt_ids[i]] + [None] * (
                len(cs) - 1)
            assert [t for c in cs for t in c["token_ids"]] == want[i]
        plain = (await h.post("/v1/completions", {**body, "return_token_ids": False})).json()
        assert all("token_ids" not in c and "prompt_token_ids" not in c
                   for c in plain["choices"])


async def test_return_token_ids_on_chat_unary_and_streamed() -> None:
    _, tok = stub_parts()
    messages = [{"role": "user", "content": "Name a colour."}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True)
    [want] = engine_tokens([text], SamplingParams(temperature=0.0, max_tokens=5,
                                                  ignore_eos=True))
    body = {"model": "stub", "messages": messages, "temperature": 0.0, "max_tokens": 5,
            "ignore_eos": True, "return_token_ids": True}
    async with serving(make_app()) as h:
        prompt_ids = (await h.post("/tokenize", {"messages": messages})).json()["tokens"]
        assert prompt_ids == tok.encode(text)
        r = (await h.post("/v1/chat/completions", body)).json()
        # As vLLM: the prompt's ids on the response (chat has one prompt), ids on the choice.
        assert r["prompt_token_ids"] == prompt_ids
        assert r["choices"][0]["token_ids"] == want
        chunks = chunks_of(await h.post("/v1/chat/completions", {**body, "stream": True}))
        assert chunks[0]["prompt_token_ids"] == prompt_ids
        assert all("prompt_token_ids" not in ch for ch in chunks[1:])
        assert [t for ch in chunks for t in ch["choices"][0]["token_ids"]] == want


async def echo(h: Any, body: dict[str, Any]) -> dict[str, Any]:
    """The unary choice, after checking that the stream adds up to it, logprobs included."""
    c: dict[str, Any] = (await h.post("/v1/completions", body)).json()["choices"][0]
    cs = by_choice(chunks_of(await h.post("/v1/completions", {**body, "stream": True})))[0]
    assert "".join(x["text"] for x in cs) == c["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for x in cs for v in x["logprobs"][key]] == c["logprobs"][key], key
    return c


async def test_echo_of_special_tokens_is_the_text_its_logprobs_describe() -> None:
    prompt = {"model": "stub", "prompt": [0, 0, 0, 0, 0], "echo": True, "logprobs": 1,
              "max_tokens": 3, "temperature": 0.0}
    async with serving(make_app()) as h:
        # Three "The" forced after the prompt: every token is in the text where
        # text_offset says, the echoed specials too.
        c = await echo(h, {**prompt, "logit_bias": {"504": 100}})
        assert c["text"] == EOT * 5 + "TheTheThe"
        assert c["logprobs"]["tokens"] == [EOT] * 5 + ["The"] * 3
        assert c["logprobs"]["text_offset"] == [0, 13, 26, 39, 52, 65, 68, 71]
        # skip_special_tokens is about generated text (vLLM's meaning): forced specials
        # after the prompt leave the text unless it is false; the echo keeps its own.
        forced = {**prompt, "logit_bias": {"0": 100}}
        c = await echo(h, forced)
        assert c["text"] == EOT * 5
        assert c["logprobs"]["tokens"] == [EOT] * 8
        c = await echo(h, {**forced, "skip_special_tokens": False})
        assert c["text"] == EOT * 8
        assert c["logprobs"]["text_offset"] == [13 * i for i in range(8)]
