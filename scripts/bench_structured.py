"""What structured outputs cost a step: a batch with half its rows under a JSON schema
against the same batch unconstrained, on SmolLM2 (its Q4_1 weights), in one run, rounds
alternating; then the parts: llguidance's mask per row, and applying 16 masks to the
logits in the sampler. Every constrained row's schema forces at least --tokens tokens
(an array of at least 40 strings), so both batches run the same number of steps.

    .venv/bin/python scripts/bench_structured.py [--rows 32] [--tokens 48] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from nanoserve.config import EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.model import load
from nanoserve.sampling.grammar import GuidedSpec, apply_bitmasks
from nanoserve.sampling.params import SamplingParams

SCHEMA = {"type": "object", "properties": {"words": {
    "type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 40}},
    "required": ["words"], "additionalProperties": False}


def run(engine: Engine, prompt: str, rows: int, constrained: int, tokens: int) -> float:
    spec = GuidedSpec.json_schema(SCHEMA)
    for i in range(rows):
        engine.add_request(prompt, SamplingParams(
            temperature=0.8, seed=i, max_tokens=tokens, ignore_eos=True,
            guided=spec if i < constrained else None))
    engine.step()  # the prefill (and first tokens), in one step, out of the timing
    t0 = time.perf_counter()
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    assert steps == tokens - 1, steps  # every row ran to max_tokens
    return rows * steps / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    model, tok = load("smollm2")
    engine = Engine(model, tok, EngineConfig(max_model_len=1024, num_blocks=512,
                                             max_num_seqs=a.rows,
                                             max_num_batched_tokens=4096))
    prompt = tok.apply_chat_template([{"role": "user", "content": "List forty words as JSON."}],
                                     add_generation_prompt=True)
    run(engine, prompt, a.rows, a.rows // 2, 4)  # warm: compile, kernels
    free, half = [], []
    for _ in range(a.rounds):
        free.append(run(engine, prompt, a.rows, 0, a.tokens))
        half.append(run(engine, prompt, a.rows, a.rows // 2, a.tokens))
    f, h = statistics.median(free), statistics.median(half)
    print(f"{a.rows} rows x {a.tokens} tokens, decode tok/s, median of {a.rounds}: "
          f"unconstrained {f:.1f}, half constrained {h:.1f} ({h / f:.3f}x); rounds "
          f"{[round(x, 1) for x in free]} / {[round(x, 1) for x in half]}")
    # The parts: a row's mask at every position of a valid instance, and 16 masks applied
    # to [rows, vocab] logits.
    m = engine.grammars.matcher(GuidedSpec.json_schema(SCHEMA))
    words = ", ".join(f'"w{i}x"' for i in range(40))
    times = []
    for t in tok.encode('{"words": [' + words + "]}"):
        t0 = time.perf_counter()
        mask = m.compute_bitmask()
        times.append(time.perf_counter() - t0)
        assert m.consume_token(t)
    times.sort()
    per_mask = statistics.mean(times)
    p99 = times[int(0.99 * (len(times) - 1))]
    logits = torch.randn(a.rows, model.config.vocab_size)
    half_rows = list(range(a.rows // 2))
    t0 = time.perf_counter()
    for _ in range(50):
        apply_bitmasks(logits.clone(), half_rows, [mask] * len(half_rows))
    per_apply = (time.perf_counter() - t0) / 50
    print(f"llguidance mask per row over {len(times)} positions: mean {per_mask * 1e6:.1f} us, "
          f"p99 {p99 * 1e6:.1f} us; applying {len(half_rows)} masks "
          f"to [{a.rows}, {model.config.vocab_size}] logits {per_apply * 1e3:.2f} ms "
          f"({per_apply / len(half_rows) * 1e6:.0f} us a row)")


if __name__ == "__main__":
    main()
