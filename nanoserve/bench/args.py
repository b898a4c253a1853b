"""`nanoserve bench`'s flags, and the workload they draw: hf_peer.py's, draw for draw."""

from __future__ import annotations

import argparse
import random

from nanoserve import flags
from nanoserve.config import speculative_config_arg
from nanoserve.model.quant import CHOICES


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
    p.add_argument("--n", type=flags.positive_int, default=32)
    p.add_argument("--seed", type=flags.int64, default=0)
    p.add_argument("--prompt-min", type=flags.positive_int, default=16)
    p.add_argument("--prompt-max", type=flags.positive_int, default=256)
    p.add_argument("--out-min", type=flags.positive_int, default=16)
    p.add_argument("--out-max", type=flags.positive_int, default=128)
    p.add_argument("--max-num-seqs", type=flags.positive_int, default=64)
    p.add_argument("--max-num-batched-tokens", type=flags.positive_int, default=512)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--quantization", default="auto", choices=CHOICES,
                   help="auto: the GGUF's own blocks; none: float32 (see nanoserve serve)")
    p.add_argument("--tensor-parallel-size", "-tp", type=flags.positive_int, default=1,
                   help="shard the weights over N processes (serve's flag) [1]")
    p.add_argument("--int8-activations", action="store_true",
                   help="8-bit activations in projections of 128+ rows and of one row "
                   "(serve's flag)")
    p.add_argument("--pack", choices=("auto", "on", "off"), default="auto",
                   help="pre-packed MKL weights (auto: wherever available)")
    p.add_argument("--profile", action="store_true",
                   help="print where the run's CPU time goes, by operator (slows the run)")
    p.add_argument("--single-tokens", type=flags.non_negative_int, default=64,
                   help="output tokens of the batch-1 decode measurement (0 skips it)")
    p.add_argument("--batched-seqs", type=flags.non_negative_int, default=16,
                   help="sequences of the batched decode measurement, 128-token prompts and "
                        "64 tokens out, prefill excluded: llama-batched-bench's TG (0 skips)")
    p.add_argument("--quiet", action="store_true", help="no progress bar (shown on a terminal)")
    p.add_argument("--speculative-config", type=speculative_config_arg, default=None,
                   help="speculative decoding, as serve's flag (vLLM's JSON); the run then "
                   "prints its acceptance and tokens a step")
    p.add_argument("--workload", choices=("random", "copy"), default="random",
                   help="random: --n prompts of random tokens; copy: nanoserve/workloads.py's "
                   "36 prompts whose answers copy from them, --out-max tokens each")
