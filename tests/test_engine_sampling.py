"""Sampling through the engine: seeded batch invariance, n > 1 forking, per-request params."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from support.drain import completion_tokens, drain

from nanoserve.config import EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.llm import LLM
from nanoserve.model.base import Model
from nanoserve.model.stub import StubModel
from nanoserve.sampling.params import ParamError, SamplingParams
from nanoserve.tokenizer import Tokenizer

SEEDED = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=1234, max_tokens=16,
                        ignore_eos=True)


def _stub(tok: Tokenizer) -> StubModel:
    return StubModel(tok, max_position_embeddings=512)


def _neighbours(i: int) -> SamplingParams:
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.7, top_p=0.5, seed=i, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=1.3, min_p=0.1, frequency_penalty=1.0, max_tokens=14,
                       ignore_eos=True),
        SamplingParams(n=2, temperature=0.9, seed=99 + i, max_tokens=11, ignore_eos=True),
    ]
    return kinds[i % len(kinds)]


def _run(engine: Engine) -> dict[tuple[str, int], list[int]]:
    return completion_tokens(drain(engine))


def _target_alone(model: Model, tok: Tokenizer, prompt: list[int]) -> list[int]:
    e = Engine(model, tok, EngineConfig(block_size=16, num_blocks=128, max_model_len=512))
    e.add_request(prompt, SEEDED, "t")
    return _run(e)[("t", 0)]


def _invariance_cases(model: Model, tok: Tokenizer, prompt: list[int]) -> None:
    alone = _target_alone(model, tok, prompt)

    # Among 16 heterogeneous neighbours, admitted before it.
    e = Engine(model, tok, EngineConfig(block_size=16, num_blocks=128, max_model_len=512))
    for i in range(16):
        e.add_request(prompt[: 5 + i] + [i + 300], _neighbours(i), f"n{i}")
    e.add_request(prompt, SEEDED, "t")
    assert _run(e)[("t", 0)] == alone

    # Arriving at a later step, into a running batch.
    e = Engine(model, tok, EngineConfig(block_size=16, num_blocks=128, max_model_len=512))
    for i in range(6):
        e.add_request(prompt[: 8 + i], _neighbours(i), f"n{i}")
    out: dict[tuple[str, int], list[int]] = {}
    for _ in range(5):
        for u in e.step().updates:
            out.setdefault((u.request_id, u.index), []).extend(u.new_token_ids)
    e.add_request(prompt, SEEDED, "t")
    for k, v in _run(e).items():
        out.setdefault(k, []).extend(v)
    assert out[("t", 0)] == alone

    # After a forced preemption: a pool too small for everyone at once.
    e = Engine(model, tok, EngineConfig(block_size=4, num_blocks=24, max_model_len=96,
                                        max_num_batched_tokens=64))
    long_tail = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)
    for i in range(4):  # 4 x ~45 tokens beside the target's ~25: more than 96 slots
        e.add_request([*prompt[:5], 400 + i], long_tail, f"n{i}")
    e.add_request(prompt, SEEDED, "t")  # admitted last, so preempted first
    results = drain(e)
    out = completion_tokens(results)
    preempted = [rid for r in results for rid in r.preempted]
    assert "t" in preempted
    assert out[("t", 0)] == alone
    assert e.pool.num_free == 24


def test_seeded_request_is_batch_invariant_on_the_stub(tok: Tokenizer) -> None:
    prompt = tok.encode("Tell me a story about a fox and a dog in Tokyo. 日本語も少し。")
    _invariance_cases(_stub(tok), tok, prompt)


@pytest.mark.real
def test_seeded_request_is_batch_invariant_on_smollm2(
    smollm2_model: Model, smollm2_folder: Path
) -> None:
    t = Tokenizer.from_folder(smollm2_folder)
    prompt = t.encode("The three most useful kitchen tools are")
    _invariance_cases(smollm2_model, t, prompt)


def test_n3_forks_share_the_prompt_blocks_once_with_ref_count_3(tok: Tokenizer) -> None:
    e = Engine(_stub(tok), tok, EngineConfig(block_size=4, num_blocks=64, max_model_len=256))
    prompt = list(range(1000, 1010))  # 2 full blocks + 2 tokens in a partial block
    params = SamplingParams(n=3, temperature=2.0, top_k=6, seed=7, max_tokens=8, ignore_eos=True)
    e.add_request(prompt, params, "r")
    first = e.step()
    assert sorted(u.index for u in first.updates) == [0, 1, 2]
    group = e.parents.members("r")
    assert [r.index for r in group] == [0, 1, 2]
    parent_blocks = group[0].blocks
    assert parent_blocks[:2] == [0, 1]
    for r in group:
        assert r.blocks[:2] == [0, 1]  # the full prompt blocks: held, not recomputed
    assert e.pool.ref_count(0) == e.pool.ref_count(1) == 3
    partials = {r.blocks[2] for r in group}
    assert len(partials) == 3  # each child writes its own copy of the partial block
    assert all(e.pool.ref_count(b) == 1 for b in partials)
    assert first.num_prefill_tokens == 10  # the prompt was computed once
    out = _run(e)
    for u in first.updates:
        out[("r", u.index)] = list(u.new_token_ids) + out.get(("r", u.index), [])
    completions = [out[("r", i)] for i in range(3)]
    assert all(len(c) == 8 for c in completions)
    assert len({tuple(c) for c in completions}) == 3
    assert e.pool.num_free == 64


def test_aborting_an_n3_request_ends_all_three(tok: Tokenizer) -> None:
    e = Engine(_stub(tok), tok, EngineConfig(block_size=4, num_blocks=64, max_model_len=256))
    e.add_request(list(range(1000, 1010)), SamplingParams(n=3, max_tokens=8), "r")
    ups = e.abort_request("r")  # before the fork: the unforked ones end too
    assert sorted((u.index, u.finish_reason) for u in ups) == [(0, "abort"), (1, "abort"),
                                                               (2, "abort")]
    assert not e.has_unfinished()
    e.add_request(list(range(1000, 1010)), SamplingParams(n=3, max_tokens=8), "r")
    e.step()
    ups = e.abort_request("r")
    assert sorted(u.index for u in ups) == [0, 1, 2]
    assert e.pool.num_free == 64


@pytest.mark.parametrize(
    ("params", "check"),
    [
        (SamplingParams(temperature=0.0, max_tokens=6, logit_bias={1234: 100}),
         lambda ids: ids == [1234] * 6),
        (SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[1234],
                        logit_bias={1234: 100}),
         lambda ids: ids == [1234]),
    ],
)
def test_logit_bias_and_stop_token_ids_act_through_the_engine(
    tok: Tokenizer, params: SamplingParams, check: object
) -> None:
    e = Engine(_stub(tok), tok, EngineConfig(block_size=4, num_blocks=64, max_model_len=256))
    e.add_request(list(range(1000, 1010)), params, "r")
    ids = _run(e)[("r", 0)]
    assert check(ids)  # type: ignore[operator]


def test_min_tokens_holds_off_eos(tok: Tokenizer) -> None:
    eos = tok.eos_token_ids[0]
    e = Engine(StubModel(tok, eos_prob=1.0, max_position_embeddings=512), tok,
               EngineConfig(block_size=4, num_blocks=64, max_model_len=256))
    e.add_request(list(range(1000, 1010)), SamplingParams(temperature=0.0, max_tokens=10), "a")
    e.add_request(list(range(1000, 1010)),
                  SamplingParams(temperature=0.0, max_tokens=10, min_tokens=4), "b")
    out = _run(e)
    assert out[("a", 0)] == [eos]
    assert len(out[("b", 0)]) == 5
    assert out[("b", 0)][-1] == eos


def test_invalid_params_admit_nothing(tok: Tokenizer) -> None:
    e = Engine(_stub(tok), tok, EngineConfig(block_size=4, num_blocks=64, max_model_len=64))
    with pytest.raises(ParamError) as info:
        e.add_request([1, 2, 3], SamplingParams(max_tokens=62))
    assert info.value.field == "max_tokens"
    with pytest.raises(ParamError) as info:
        e.add_request([1, 2, 3], SamplingParams(logit_bias={10**6: 1.0}))
    assert info.value.field == "logit_bias"
    assert not e.has_unfinished()
    assert e.statistics().waiting == 0


# The issue's own example: three sampled siblings of one prompt.
N3 = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)


def _siblings(model: Model, tok: Tokenizer, params: SamplingParams,
              neighbours: int = 0) -> list[tuple[int, ...]]:
    llm = LLM.from_parts(model, tok, EngineConfig(block_size=16, num_blocks=128,
                                                  max_model_len=512))
    prompts: list[list[int]] = [[*tok.encode("x"), 300 + i] for i in range(neighbours)]
    per = [_neighbours(i) for i in range(neighbours)]
    outs = llm.generate([*prompts, tok.encode("x")], [*per, params])
    return [c.token_ids for c in outs[-1].outputs]


def _sibling_cases(model: Model, tok: Tokenizer) -> list[tuple[int, ...]]:
    seeded = _siblings(model, tok, N3)
    assert len(set(seeded)) == 3  # seeds 5, 6, 7: three different completions
    unseeded = _siblings(model, tok, dataclasses.replace(N3, seed=None))
    assert len(set(unseeded)) == 3  # seeds derived per child from the request's
    assert _siblings(model, tok, N3) == seeded  # reproducible
    return seeded


def test_n_siblings_differ_on_the_stub(tok: Tokenizer) -> None:
    """The stub once gave its top candidate 97% of the mass at temperature 1, so siblings,
    which share a history and therefore the stub's logits, almost never parted: three
    identical children seeded, two of three unseeded. Its candidates now spread as
    SmolLM2's do (model/stub.py)."""
    seeded = _sibling_cases(_stub(tok), tok)
    assert _siblings(_stub(tok), tok, N3, neighbours=12) == seeded  # and batch-invariant


@pytest.mark.real
def test_n_siblings_differ_on_smollm2(smollm2_model: Model, smollm2_folder: Path) -> None:
    # Not checked here: the same siblings among 12 neighbours. On real weights a row's
    # float32 logits depend in their last bits on the step's batch shape (logprobs moved by
    # up to 5e-5 here), so a draw that lands that close to a boundary can flip: one token in
    # 24 did. test_seeded_request_is_batch_invariant_on_smollm2 holds for its own prompt.
    _sibling_cases(smollm2_model, Tokenizer.from_folder(smollm2_folder))
