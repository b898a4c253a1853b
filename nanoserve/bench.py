"""`nanoserve bench`: the offline throughput benchmark, on the workload hf_peer.py uses.

The workload is built exactly as ../shared/bench/hf_peer.py builds it (same seeded
generator, same draws in the same order), so the two programs' figures compare like for
like: greedy, EOS ignored, every request yields exactly its drawn output length.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from nanoserve.config import EngineConfig
from nanoserve.llm import LLM
from nanoserve.model import load
from nanoserve.sampling import SamplingParams


def workload(
    seed: int, n: int, vocab_size: int, prompt_min: int, prompt_max: int, out_min: int, out_max: int
) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        prompt_len = rng.randint(prompt_min, prompt_max)
        prompt = [rng.randrange(100, vocab_size - 100) for _ in range(prompt_len)]
        reqs.append((prompt, rng.randint(out_min, out_max)))
    return reqs


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2")
    p.add_argument("--n", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-min", type=int, default=16)
    p.add_argument("--prompt-max", type=int, default=256)
    p.add_argument("--out-min", type=int, default=16)
    p.add_argument("--out-max", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")


def run(a: argparse.Namespace) -> dict[str, float | int]:
    model, tok = load(a.model, device=a.device, dtype=a.dtype)
    cfg = EngineConfig(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens)
    llm = LLM.from_parts(model, tok, cfg)
    reqs = workload(a.seed, a.n, model.config.vocab_size, a.prompt_min, a.prompt_max,
                    a.out_min, a.out_max)
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=o) for _, o in reqs]
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params)
    seconds = time.perf_counter() - t0
    produced = sum(len(o.token_ids) for o in outs)
    expected = sum(o for _, o in reqs)
    if produced != expected:
        raise RuntimeError(f"produced {produced} output tokens, the workload asks for {expected}")
    prompt_tokens = sum(len(p) for p, _ in reqs)
    stats = llm.engine.statistics()
    result: dict[str, float | int] = {
        "requests": len(reqs),
        "output_tokens": produced,
        "prompt_tokens": prompt_tokens,
        "seconds": round(seconds, 3),
        "output_tokens_per_s": round(produced / seconds, 2),
        "total_tokens_per_s": round((produced + prompt_tokens) / seconds, 2),
        "steps": stats.steps,
        "preemptions": stats.preemptions,
    }
    print(f"nanoserve: {produced} output tokens in {seconds:.2f}s = "
          f"{produced / seconds:.1f} tok/s ({stats.steps} steps)")
    print(json.dumps(result))
    return result
