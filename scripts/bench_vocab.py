"""What a 262,144-token vocabulary (Gemma 3's) costs the sampler and structured outputs,
beside SmolLM2's 49,152, in one run: a step's `sample` over 16 rows of logits, greedy and
with everything on (temperature, top-p, top-k, repetition penalty, logit bias, 5
logprobs); then compiling a JSON schema with llguidance for each tokenizer, a row's mask
along a valid instance, and applying 8 masks to [16, vocab] logits. Medians of --rounds.

    .venv/bin/python scripts/bench_vocab.py [--rounds 20]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from nanoserve.model.loader import resolve_model
from nanoserve.sampling.grammar import Grammars, GuidedSpec, apply_bitmasks
from nanoserve.sampling.params import SamplingParams
from nanoserve.sampling.sampler import SamplingRow, sample
from nanoserve.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "tags": {"type": "array", "items": {"type": "string"}},
                                           "n": {"type": "integer"}},
          "required": ["name", "tags", "n"], "additionalProperties": False}
INSTANCE = '{"name": "Ærøskøbing harbour", "tags": ["a", "bb", "ccc"], "n": 12345}'
ROWS = 16


def median_ms(fn: Callable[[], object], rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def sampler_ms(vocab: int, rounds: int) -> tuple[float, float]:
    torch.manual_seed(0)
    logits = torch.randn(ROWS, vocab)
    history = list(range(100, 400))
    greedy = [SamplingRow(SamplingParams(temperature=0.0), 0, 0, history, []) for _ in
              range(ROWS)]
    full = [SamplingRow(SamplingParams(temperature=0.8, top_p=0.9, top_k=50,
                                       repetition_penalty=1.1, logit_bias={5: -2.0},
                                       logprobs=5, seed=i), i, 3, history, [7, 8, 9])
            for i in range(ROWS)]
    return (median_ms(lambda: sample(logits, greedy, [1]), rounds),
            median_ms(lambda: sample(logits, full, [1]), rounds))


def grammar_figures(name: str, rounds: int) -> tuple[int, float, float, float]:
    tok = Tokenizer.from_folder(resolve_model(name))
    t0 = time.perf_counter()
    grammars = Grammars(tok, tok.vocab_size)
    grammars.check(GuidedSpec.json_schema(SCHEMA))
    first = (time.perf_counter() - t0) * 1e3  # the tokenizer's view and the schema, cold
    matcher = grammars.matcher(GuidedSpec.json_schema(SCHEMA))
    per_mask = []
    mask = b""
    for t in tok.encode(INSTANCE):
        t0 = time.perf_counter()
        mask = matcher.compute_bitmask()
        per_mask.append(time.perf_counter() - t0)
        assert matcher.consume_token(t)
    logits = torch.randn(ROWS, tok.vocab_size)
    apply = median_ms(lambda: apply_bitmasks(logits.clone(), list(range(8)), [mask] * 8),
                      rounds)
    return tok.vocab_size, first, statistics.mean(per_mask) * 1e6, apply


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=20)
    a = p.parse_args()
    for name in ("smollm2", "gemma3-270m"):
        vocab, first, mask_us, apply_ms = grammar_figures(name, a.rounds)
        greedy_ms, full_ms = sampler_ms(vocab, a.rounds)
        print(f"{name} (vocabulary {vocab}): sample {ROWS} rows greedy {greedy_ms:.2f} ms, "
              f"everything on {full_ms:.2f} ms; llguidance: tokenizer view + schema cold "
              f"{first:.0f} ms, a row's mask {mask_us:.0f} us mean, 8 masks applied to "
              f"[{ROWS}, {vocab}] {apply_ms:.2f} ms")


if __name__ == "__main__":
    main()
