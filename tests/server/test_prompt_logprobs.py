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
from http_harness import serving, stub_parts
from reference import NEAR_TIE, load_reference

from nanoserve.config import EngineConfig
from nanoserve.engine import Engine
from nanoserve.llm import LLM
from nanoserve.model.base import ForwardBatch
from nanoserve.model.llama import LlamaModel
from nanoserve.outputs import RequestOutput
from nanoserve.sampler import TokenLogprobs
from nanoserve.sampling import SamplingParams
from nanoserve.server import ServerConfig, counter_ids, create_app
from nanoserve.serving.clock import StepClock
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
