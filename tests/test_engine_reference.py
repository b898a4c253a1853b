"""Token identity with the reference oracle through the whole engine, on real weights.

Every fixture prompt (20+, 10 to 500 tokens, several scripts, emoji, code) is decoded
greedily for 32 tokens, once alone and once all together in one continuous batch whose
token budget forces chunked prefill and whose small pool forces preemption by recompute.
Both must match Hugging Face transformers' greedy output (tests/support/reference.py says which
divergences a near-tie excuses); the pool must end with every block free.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.drain import drain, tokens
from support.reference import MAX_NEW_TOKENS, compare_greedy, load_reference

from nanoserve.config import EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.model.base import ForwardBatch
from nanoserve.model.llama import LlamaModel
from nanoserve.sampling.params import SamplingParams
from nanoserve.tokenizer import Tokenizer

pytestmark = pytest.mark.real

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)


def _drain(engine: Engine) -> dict[str, list[int]]:
    return tokens(drain(engine))


def test_each_prompt_alone_matches_the_reference(
    smollm2_any: LlamaModel, smollm2_folder: Path
) -> None:
    smollm2_model = smollm2_any
    cases = load_reference()
    assert len(cases) >= 20
    if smollm2_model.stack is None:
        # float32 weights (no decode stack): every other prompt alone, the suite's time;
        # the batched test below runs every prompt on them, and the quantized model, the
        # default, takes every prompt alone.
        cases = cases[::2]
    tok = Tokenizer.from_folder(smollm2_folder)
    cfg = EngineConfig(block_size=16, num_blocks=64, max_model_len=1024, prefix_caching=False)
    engine = Engine(smollm2_model, tok, cfg)
    problems: list[str] = []
    for case in cases:
        engine.add_request(list(case.prompt_ids), GREEDY, case.name)
        got = _drain(engine)[case.name]
        bad, ties = compare_greedy(case, got)
        problems += bad
        if ties:
            print(f"near-tie divergence (alone): {case.name} at token {ties[0]}")
    assert not problems, "\n".join(problems)
    assert engine.pool.num_free == 64


def test_all_prompts_in_one_batch_with_chunking_and_preemption_match_the_reference(
    smollm2_any: LlamaModel, smollm2_folder: Path
) -> None:
    smollm2_model = smollm2_any
    cases = load_reference()
    tok = Tokenizer.from_folder(smollm2_folder)
    # 60 blocks of 16 = 960 tokens of KV for 20+ sequences that need ~4,000 together:
    # admission stalls and running requests are preempted and recomputed. A budget of 96
    # tokens a step splits every prompt over 16 into chunks.
    cfg = EngineConfig(
        block_size=16, num_blocks=60, max_model_len=600, max_num_seqs=24,
        max_num_batched_tokens=96,
    )
    engine = Engine(smollm2_model, tok, cfg)
    for case in cases:
        engine.add_request(list(case.prompt_ids), GREEDY, case.name)
    results = drain(engine)
    chunked = sum(r.num_prefill_tokens == 96 for r in results)
    outputs = tokens(results)
    stats = engine.statistics()
    assert stats.preemptions >= 1
    assert chunked >= 1
    problems: list[str] = []
    for case in cases:
        bad, ties = compare_greedy(case, outputs[case.name])
        problems += bad
        if ties:
            print(f"near-tie divergence (batched): {case.name} at token {ties[0]}")
    assert not problems, "\n".join(problems)
    print(f"batched run: {stats.steps} steps, {stats.preemptions} preemptions, "
          f"{stats.prefill_tokens} prefill tokens")
    assert engine.pool.num_free == 60
    assert all(engine.pool.ref_count(b) == 0 for b in range(60))


def test_logits_stay_close_to_the_reference(smollm2_any: LlamaModel) -> None:
    """The reference's top-5 logits at each of its 32 generated positions, against ours on
    the same tokens (teacher-forced): the quantized weights are the reference's own values,
    so only the order of additions may move a logit."""
    model, worst = smollm2_any, 0.0
    model.init_kv_cache(64, 16)
    for case in load_reference():
        ids = [*case.prompt_ids, *case.tokens[:-1]]
        n, first = len(ids), len(case.prompt_ids) - 1
        batch = ForwardBatch(
            input_ids=ids, positions=list(range(n)), slot_mapping=list(range(n)),
            query_lens=[n], context_lens=[n], block_tables=[list(range((n + 15) // 16))],
            logits_indices=list(range(first, n)), histories=[ids], seeds=[0])
        logits = model.forward(batch)  # [32, vocab]
        for pos, top in enumerate(case.top5):
            for token, value in top:
                worst = max(worst, abs(float(logits[pos, token]) - value))
    print(f"max |logit diff| against the reference's top-5: {worst:.3g}")
    assert worst < 2e-3
