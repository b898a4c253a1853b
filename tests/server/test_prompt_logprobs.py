"""Prompt logprobs (params.prompt_logprobs) and `echo` with `logprobs` on /v1/completions.

The expected numbers come from one plain forward of the whole prompt with logits at every
position (the stub's for the engine and HTTP shape tests, SmolLM2's for the real ones),
and on real weights also from the Hugging Face reference fixture: feeding a reference case's
prompt plus its greedy continuation as a prompt, the prompt logprobs at the continuation's
positions must rank the same top tokens with the same logit gaps that HF recorded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from support.http_harness import serving, stub_parts
from support.reference import NEAR_TIE, load_reference

from nanoserve.bridge.clock import StepClock
from nanoserve.config import EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.engine.outputs import RequestOutput
from nanoserve.llm import LLM
from nanoserve.model.base import ForwardBatch
from nanoserve.model.llama import LlamaModel
from nanoserve.sampling.params import MAX_LOGPROBS, SamplingParams
from nanoserve.sampling.sampler import TokenLogprobs
from nanoserve.server import ServerConfig, counter_ids, create_app
from nanoserve.server.token_text import TokenText
from nanoserve.tokenizer import Tokenizer

PROMPT = [1000 + (i * 37) % 900 for i in range(40)]  # 40 tokens: 3 blocks of 16, chunked


def engine(**cfg: Any) -> Engine:
    model, tok = stub_parts()
    base: dict[str, Any] = {"block_size": 16, "num_blocks": 64, "max_model_len": 256}
    return Engine(model, tok, EngineConfig(**{**base, **cfg}))


def generate(e: Engine, prompts: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
    llm = LLM.__new__(LLM)
    llm.engine = e
    return llm.generate(prompts, params)  # type: ignore[arg-type]


def full_forward_logprobs(model: Any, prompt: list[int], seed: int = 0) -> torch.Tensor:
    """[P - 1, V] log-softmax of the logits at positions 0 .. P-2, from one forward of the
    whole prompt into fresh cache slots 0 .. P-1 (the engine's cache must be unused)."""
    n = len(prompt)
    bs = 16
    batch = ForwardBatch(
        input_ids=list(prompt), positions=list(range(n)), slot_mapping=list(range(n)),
        query_lens=[n], context_lens=[n], block_tables=[list(range(-(-n // bs)))],
        logits_indices=list(range(n - 1)), histories=[list(prompt)], seeds=[seed],
    )
    return model.forward(batch).float().log_softmax(dim=-1)


def check_against(lps: tuple[TokenLogprobs | None, ...], prompt: list[int], ref: torch.Tensor,
                  k: int, atol: float) -> None:
    assert len(lps) == len(prompt)
    assert lps[0] is None
    for p, lp in enumerate(lps[1:]):
        assert lp is not None
        assert lp.token_id == prompt[p + 1]
        assert lp.logprob == pytest.approx(ref[p, prompt[p + 1]].item(), abs=atol)
        assert lp.rank == int((ref[p] > ref[p, prompt[p + 1]]).sum()) + 1
        assert len(lp.top) == k
        top = ref[p].topk(k)
        assert [t for t, _ in lp.top] == top.indices.tolist()


# -- engine, stub model ---------------------------------------------------------------------


def test_chunked_prefill_scores_every_prompt_token_once() -> None:
    e = engine(max_num_batched_tokens=16)  # 40 prompt tokens: chunks of 16, 16, 8
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    [out] = generate(e, [PROMPT], params)
    assert e.num_steps == 3 + 2  # three prefill chunks, then two decode steps
    assert out.prompt_logprobs is not None
    model, _ = stub_parts()
    check_against(out.prompt_logprobs, PROMPT, full_forward_logprobs(model, PROMPT), 2, 0.0)
    # Asking for them changes nothing else.
    [plain] = generate(engine(), [PROMPT], SamplingParams(temperature=0.0, max_tokens=3,
                                                           ignore_eos=True))
    assert plain.prompt_logprobs is None
    assert plain.token_ids == out.token_ids
    assert e.pool.num_free == 64


def test_a_request_owing_prompt_logprobs_skips_the_prefix_cache() -> None:
    e = engine()
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    generate(e, [PROMPT], greedy)  # leaves 2 full blocks of PROMPT in the cache
    [scored] = generate(e, [PROMPT], SamplingParams(temperature=0.0, max_tokens=2,
                                                    ignore_eos=True, prompt_logprobs=0))
    assert scored.num_cached_tokens == 0
    assert scored.prompt_logprobs is not None
    model, _ = stub_parts()
    check_against(scored.prompt_logprobs, PROMPT, full_forward_logprobs(model, PROMPT), 0, 0.0)
    [again] = generate(e, [PROMPT], greedy)  # and the cache still serves everyone else
    assert again.num_cached_tokens == 32


def test_preemption_and_n_siblings_do_not_score_twice() -> None:
    # 4 requests x (40 + 24) tokens need 16 blocks of 16; 10 blocks force preemption.
    prompts = [[t + i for t in PROMPT] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prompt_logprobs=1,
                            n=2)
    big = generate(engine(), prompts, params)
    e = engine(num_blocks=10, max_model_len=160, max_num_batched_tokens=32)
    small = generate(e, prompts, params)
    assert e.statistics().preemptions > 0
    model, _ = stub_parts()
    for p, a, b in zip(prompts, big, small, strict=True):
        assert a.prompt_logprobs == b.prompt_logprobs
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        assert b.prompt_logprobs is not None
        check_against(b.prompt_logprobs, p, full_forward_logprobs(model, p), 1, 0.0)
    assert e.pool.num_free == 10


# -- HTTP shape, stub model -------------------------------------------------------------------


def app() -> Any:
    return create_app(engine(max_num_batched_tokens=16), ServerConfig("stub"), clock=StepClock(),
                      id_source=counter_ids(), time_source=lambda: 1.0)


async def test_echo_with_logprobs_unary_and_stream_agree() -> None:
    model, tok = stub_parts()
    body = {"model": "stub", "prompt": PROMPT, "max_tokens": 5, "temperature": 0.0,
            "echo": True, "logprobs": 2, "ignore_eos": True}
    async with serving(app()) as h:
        r = await h.post("/v1/completions", body)
        assert r.status == 200, r.body
        c = r.json()["choices"][0]
        lp = c["logprobs"]
        n = len(PROMPT) + 5
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
        assert lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None
        assert all(v is not None for v in lp["token_logprobs"][1:])
        ref = full_forward_logprobs(model, PROMPT)
        for p in range(1, len(PROMPT)):
            assert lp["token_logprobs"][p] == pytest.approx(ref[p - 1, PROMPT[p]].item())
            assert len(lp["top_logprobs"][p]) in (2, 3)  # the top 2, plus the token if not in it
        # text_offset runs over the token strings of the echoed prompt and the completion.
        lens = [len(t) for t in lp["tokens"]]
        assert lp["text_offset"] == [sum(lens[:i]) for i in range(n)]
        assert c["text"].startswith(tok.decode(PROMPT))

        chunks = [json.loads(ev) for ev in (await h.post("/v1/completions",
                                                          {**body, "stream": True})).events()
                  if ev != "[DONE]"]
        first = chunks[0]["choices"][0]
        assert first["text"].startswith(tok.decode(PROMPT))
        assert len(first["logprobs"]["tokens"]) >= len(PROMPT) + 1  # prompt rides the first
        joined: dict[str, list[Any]] = {k: [] for k in lp}
        for ch in chunks:
            for k in joined:
                joined[k] += ch["choices"][0]["logprobs"][k]
        assert joined == lp
        assert "".join(ch["choices"][0]["text"] for ch in chunks) == c["text"]


async def test_logprobs_without_echo_still_skip_the_prompt() -> None:
    body = {"model": "stub", "prompt": PROMPT, "max_tokens": 3, "temperature": 0.0,
            "logprobs": 1, "ignore_eos": True}
    async with serving(app()) as h:
        lp = (await h.post("/v1/completions", body)).json()["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == 3
        assert lp["text_offset"][0] == 0


# -- real weights -------------------------------------------------------------------------------


@pytest.mark.real
def test_real_prompt_logprobs_match_a_full_forward_and_the_reference(
    smollm2_model: LlamaModel, smollm2_tokenizer: Tokenizer, smollm2_folder: Path
) -> None:
    cases = {c.name: c for c in load_reference()}
    # Logits of a whole prompt at once, in fresh slots; then the engine, chunked by 16.
    case = cases["chat_math"]
    prompt = list(case.prompt_ids) + list(case.tokens)
    cfg = EngineConfig(block_size=16, num_blocks=64, max_model_len=1024,
                       max_num_batched_tokens=16)
    e = Engine(smollm2_model, smollm2_tokenizer, cfg)  # (re)initialises the cache
    ref = full_forward_logprobs(smollm2_model, prompt)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=5)
    [out] = generate(e, [prompt], params)
    assert out.prompt_logprobs is not None
    check_against(out.prompt_logprobs, prompt, ref, 5, 1e-4)
    # Against Hugging Face: at each of the continuation's positions, the same top tokens
    # (up to a near tie) with the same gaps between their logits.
    p0 = len(case.prompt_ids)
    for i, top5 in enumerate(case.top5):
        lp = out.prompt_logprobs[p0 + i]
        assert lp is not None
        assert lp.token_id == case.tokens[i]
        ours = dict(lp.top)
        best = top5[0][1]
        for tok, logit in top5:
            if tok in ours:
                assert ours[tok] - lp.top[0][1] == pytest.approx(logit - best, abs=2e-3)
            else:  # only a token tied with the fifth may fall out of our top five
                assert abs(logit - top5[-1][1]) < NEAR_TIE


# -- prompt_logprobs over HTTP: vLLM's field and shape ------------------------------------------


def vllm_shape(lps: tuple[TokenLogprobs | None, ...] | None, tok: Tokenizer) -> list[Any]:
    """The engine's prompt logprobs as vLLM writes them: null first, then per token a map of
    token id (a string) to {logprob, rank, decoded_token}, the prompt's token first, then
    its alternatives ranked 1, 2, ... (a token among them keeps its first entry)."""
    assert lps is not None
    text = TokenText(tok)
    out: list[Any] = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        entry = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank,
                                    "decoded_token": text.text(lp.token_id)}}
        for rank, (t, v) in enumerate(lp.top, 1):
            entry.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": text.text(t)})
        out.append(entry)
    return out


def sse_chunks(r: Any) -> list[dict[str, Any]]:
    assert r.status == 200, r.body
    events = r.events()
    assert events[-1] == "[DONE]"
    return [json.loads(ev) for ev in events[:-1]]


def first_chunks(chunks: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Each choice's first chunk, by index (the chunk itself for chat, its choice else)."""
    out: dict[int, dict[str, Any]] = {}
    for ch in chunks:
        for c in ch["choices"]:
            out.setdefault(c["index"], ch if ch["object"] == "chat.completion.chunk" else c)
    return out


STUB_PROMPTS = ["The quick brown fox", "def step(self):", "日本語のテキスト"]


async def test_prompt_logprobs_on_completions_equal_the_engines() -> None:
    model, tok = stub_parts()
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    llm = LLM.from_parts(model, tok, EngineConfig(block_size=16, num_blocks=64,
                                                  max_model_len=256))
    want = [vllm_shape(o.prompt_logprobs, tok)
            for o in llm.generate(STUB_PROMPTS, params, use_tqdm=False)]
    # The shape, spelled out for the first prompt: no entry for its first token; its tokens
    # as text; the prompt's token first in each map, then the two best, ranked 1 and 2.
    assert want[0][0] is None
    assert [next(iter(e.values()))["decoded_token"] for e in want[0][1:]] == [
        " quick", " brown", " fox"]
    for e, t in zip(want[0][1:], tok.encode(STUB_PROMPTS[0])[1:], strict=True):
        assert next(iter(e)) == str(t)
        own = e[str(t)]["rank"]
        assert [v["rank"] for v in list(e.values())[1:]] == [r for r in (1, 2) if r != own]
    body = {"model": "stub", "prompt": STUB_PROMPTS, "max_tokens": 2, "temperature": 0.0,
            "ignore_eos": True, "prompt_logprobs": 2}
    async with serving(app()) as h:
        r = await h.post("/v1/completions", body)
        assert r.status == 200, r.body
        choices = r.json()["choices"]
        assert [c["prompt_logprobs"] for c in choices] == want
        assert all(c["logprobs"] is None for c in choices)  # the completion's own: not asked
        # Streamed (vLLM refuses this; here the prompt's ride on each choice's first chunk).
        chunks = sse_chunks(await h.post("/v1/completions", {**body, "stream": True}))
        firsts = first_chunks(chunks)
        assert [firsts[i]["prompt_logprobs"] for i in range(3)] == want
        assert sum("prompt_logprobs" in c for ch in chunks for c in ch["choices"]) == 3
        # Without echo the completion's logprobs are its own tokens' only.
        lps = (await h.post("/v1/completions", {**body, "logprobs": 1})).json()["choices"]
        assert [len(c["logprobs"]["tokens"]) for c in lps] == [2, 2, 2]
        assert [c["prompt_logprobs"] for c in lps] == want
        # Not asked for: not there.
        plain = (await h.post("/v1/completions", {**body, "prompt_logprobs": None})).json()
        assert all("prompt_logprobs" not in c for c in plain["choices"])


async def test_echo_scores_the_prompt_with_prompt_logprobs_but_lists_logprobs_alternatives(
) -> None:
    # As vLLM: an explicit prompt_logprobs decides the prompt's scoring; the echoed tokens'
    # top_logprobs still hold `logprobs` alternatives (plus the token itself).
    body = {"model": "stub", "prompt": PROMPT, "max_tokens": 2, "temperature": 0.0,
            "ignore_eos": True, "echo": True, "logprobs": 1, "prompt_logprobs": 3}
    async with serving(app()) as h:
        c = (await h.post("/v1/completions", body)).json()["choices"][0]
        model, tok = stub_parts()
        plps = c["prompt_logprobs"]
        assert len(plps) == len(PROMPT)
        text = TokenText(tok)
        for p in range(1, len(PROMPT)):
            ranked = sorted(plps[p].items(), key=lambda kv: kv[1]["rank"])
            best = {text.text(int(t)): v["logprob"] for t, v in ranked if v["rank"] == 1}
            want = {**best, text.text(PROMPT[p]): plps[p][str(PROMPT[p])]["logprob"]}
            assert c["logprobs"]["top_logprobs"][p] == want
            assert len([v for v in plps[p].values() if v["rank"] <= 3]) >= 3


async def test_prompt_logprobs_on_chat_go_on_the_response() -> None:
    model, tok = stub_parts()
    messages = [{"role": "user", "content": "Name a colour."}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True)
    llm = LLM.from_parts(model, tok, EngineConfig(block_size=16, num_blocks=64,
                                                  max_model_len=256))
    [out] = llm.generate(text, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True,
                                              prompt_logprobs=0), use_tqdm=False)
    want = vllm_shape(out.prompt_logprobs, tok)
    ids = tok.encode(text)
    assert ids[0] == 1  # <|im_start|>, unscored; later ones are scored, shown as themselves
    assert [next(iter(e.values()))["decoded_token"] for e in want[1:]] == [
        tok.decode([t], skip_special_tokens=False) for t in ids[1:]]
    assert [e[str(t)]["decoded_token"] for e, t in zip(want[1:], ids[1:], strict=True)
            if t == 1] == ["<|im_start|>"] * 2
    body = {"model": "stub", "messages": messages, "max_tokens": 2, "temperature": 0.0,
            "ignore_eos": True, "prompt_logprobs": 0}
    async with serving(app()) as h:
        r = (await h.post("/v1/chat/completions", body)).json()
        assert r["prompt_logprobs"] == want
        assert all(len(e) == 1 for e in want[1:])  # 0 alternatives: the prompt's token alone
        chunks = sse_chunks(await h.post("/v1/chat/completions", {**body, "stream": True}))
        assert chunks[0]["prompt_logprobs"] == want
        assert all("prompt_logprobs" not in ch for ch in chunks[1:])


@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1])
async def test_prompt_logprobs_out_of_range_is_a_400_naming_it(value: int) -> None:
    async with serving(app()) as h:
        for path, extra in (("/v1/completions", {"prompt": "hi"}),
                            ("/v1/chat/completions", {"messages": [
                                {"role": "user", "content": "hi"}]})):
            r = await h.post(path, {**extra, "max_tokens": 1, "prompt_logprobs": value})
            assert r.status == 400, r.body
            assert r.json()["error"]["param"] == "prompt_logprobs"


REAL_PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time,",
    "The quick brown fox jumps over", "import numpy as np", "My favourite colour is",
    "2 + 2 =", "The Moon orbits", "Dear Sir or Madam,",
]


@pytest.mark.real
async def test_real_prompt_logprobs_over_http_equal_the_engines(
    smollm2_model: LlamaModel, smollm2_tokenizer: Tokenizer
) -> None:
    """Ten prompts through LLM.generate and through the server, which runs them on the same
    weights and the same engine settings: the same numbers, to the bit, unary and streamed,
    completions (the ten in one request, as LLM.generate batches them) and chat (one at a
    time on both sides, so each row sees the same batch)."""
    tok = smollm2_tokenizer
    cfg = EngineConfig(block_size=16, num_blocks=128, max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3)
    llm = LLM.from_parts(smollm2_model, tok, cfg)  # (re)initialises the model's cache
    want = [vllm_shape(o.prompt_logprobs, tok)
            for o in llm.generate(REAL_PROMPTS, params, use_tqdm=False)]
    chats = [[{"role": "user", "content": p}] for p in REAL_PROMPTS]
    want_chat = [vllm_shape(llm.chat(m, params).prompt_logprobs, tok) for m in chats]
    assert want[0][1]["3575"]["decoded_token"] == " capital"  # the prompt's own token, named

    server = create_app(Engine(smollm2_model, tok, cfg), ServerConfig("smollm2"),
                        clock=StepClock(), id_source=counter_ids(), time_source=lambda: 1.0)
    body = {"prompt": REAL_PROMPTS, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 3}
    async with serving(server) as h:
        r = await h.post("/v1/completions", body)
        assert r.status == 200, r.body
        assert [c["prompt_logprobs"] for c in r.json()["choices"]] == want
        firsts = first_chunks(sse_chunks(await h.post("/v1/completions",
                                                      {**body, "stream": True})))
        assert [firsts[i]["prompt_logprobs"] for i in range(10)] == want
        for m, w in zip(chats, want_chat, strict=True):
            chat = {"messages": m, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 3}
            r = await h.post("/v1/chat/completions", chat)
            assert r.status == 200, r.body
            assert r.json()["prompt_logprobs"] == w
            chunks = sse_chunks(await h.post("/v1/chat/completions", {**chat, "stream": True}))
            assert chunks[0]["prompt_logprobs"] == w
