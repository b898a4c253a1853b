"""`nanoserve bench`: the offline throughput benchmark, on the workload hf_peer.py uses.

The workload is built exactly as ../shared/bench/hf_peer.py builds it (same seeded
generator, same draws in the same order), so the two programs' figures compare like for
like: greedy, EOS ignored, every request yields exactly its drawn output length.

Absolute figures on a shared CPU drift with whatever else runs, so every figure comes with
a yardstick measured in the same process: the compute throughput against a 2048 x 2048
float32 `torch.mm` (the fraction of that peak the whole run sustains, counting 2 FLOP per
weight per computed token, prompt and output), and batch-1 decode against the
memory-bandwidth bound (every weight read once per token, at the speed the kernels' own
threads read a buffer of the weights' size, measured right after it). The mm is timed
before and after the run and the faster taken: one timing in a slow minute once came out
at half speed, which made the run look twice as good. `--pack off` runs the same workload
without pre-packed weights, for an old-versus-new comparison.

Two more lines measure what llama.cpp's benchmarks measure, for a side by side on the same
terms (sim/bench/llamacpp.py): batch-1 decode (`llama-bench -n`), and 16 sequences of
128-token prompts decoding 64 tokens with the prefill excluded (`llama-batched-bench`'s TG).
The first line names the instruction set the kernels run (NANOSERVE_ISA forces one).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch

from nanoserve import flags
from nanoserve.config import ConfigError, EngineConfig, SpeculativeConfig, speculative_config_arg
from nanoserve.engine.engine import Engine
from nanoserve.engine.outputs import EngineStats
from nanoserve.llm import LLM
from nanoserve.model import Model, load
from nanoserve.model.native import Kernels
from nanoserve.model.preflight import check_device, check_int8_activations, check_model
from nanoserve.model.quant import CHOICES
from nanoserve.sampling.params import SamplingParams
from nanoserve.tokenizer import Tokenizer
from nanoserve.workloads import copy_prompts

Figures = dict[str, float | int | str]  # a run's figures by name, as the JSON line prints them


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


def _best_of(fn: Callable[[], object], times: int) -> float:
    fn()  # warm-up: first-touch page faults and kernel selection
    best = float("inf")
    for _ in range(times):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def mm_flops(n: int = 2048) -> float:
    """FLOP/s of one n x n float32 matmul: the compute yardstick."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / _best_of(lambda: torch.mm(a, b), 5)


def copy_bandwidth(nbytes: int = 256 << 20) -> float:
    """Bytes/s moved (read plus write) by copying a tensor far larger than any cache."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_of(lambda: dst.copy_(src), 5)


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size (Linux's sysfs: "32768K"), or 0 where it does not tell."""
    sizes = [0]
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            text = f.read_text(encoding="ascii").strip()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[text[-1]] if text[-1] in "KMG" else 1
            sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes)


def read_bandwidth(nbytes: int, kernels: Kernels | None = None) -> float:
    """Bytes/s read, with no writes, from a buffer of `nbytes`: what batch-1 decode does to
    its weights. Read by the kernels' own threads, each a contiguous run of bytes
    (csrc/quant.cpp's stream_read); by torch's sum where there are no kernels."""
    buf = torch.ones(max(nbytes, 1 << 20) // 64 * 64, dtype=torch.uint8)
    if kernels is not None:
        return buf.numel() / _best_of(lambda: kernels.ops.stream_read(buf), 5)
    floats = buf.view(torch.float32)
    return buf.numel() / _best_of(lambda: floats.sum(), 5)


def weight_numel(model: Model) -> int:
    """Weights a token multiplies by: every layer's projections and the LM head (the
    embedding is a row look-up). 2 FLOP and one read of each per token."""
    c = model.config
    attn = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    attn += c.num_heads * c.head_dim * c.hidden_size
    mlp = 3 * c.hidden_size * c.intermediate_size
    return c.num_layers * (attn + mlp) + c.vocab_size * c.hidden_size


class _TimedModel:
    """A model whose forward passes (and greedy picks) are timed: what is left of a step is
    the engine's Python around them (scheduling, batch building, sampling, detokenizing,
    the stop rules)."""

    def __init__(self, model: Model) -> None:
        self._model = model
        self.seconds = 0.0

    def __getattr__(self, name: str) -> object:
        return getattr(self._model, name)

    def _timed(self, fn: Callable[..., object], *args: object) -> object:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds += time.perf_counter() - t0

    def forward(self, batch: object) -> object:
        return self._timed(self._model.forward, batch)

    def pick_greedy(self, batch: object) -> object:
        return self._timed(self._model.pick_greedy, batch)


def step_overhead(model: Model, tok: Tokenizer, prompt: list[int], n: int) -> Figures:
    """Batch-1 decode steps split into the model's time and the engine's time around it,
    ms per step (best of three runs of n - 1 decode steps, by step time)."""
    timed = _TimedModel(model)
    engine = Engine(timed, tok, EngineConfig())  # type: ignore[arg-type]  # a proxy
    best: Figures = {}
    best_step = float("inf")
    for _ in range(3):
        engine.add_request(prompt, SamplingParams(temperature=0.0, ignore_eos=True,
                                                  max_tokens=n))
        engine.step()  # the prefill
        timed.seconds = 0.0
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        step = (time.perf_counter() - t0) / (n - 1)
        if step < best_step:
            best_step = step
            model_ms = timed.seconds / (n - 1) * 1e3
            best = {"step_ms": round(step * 1e3, 3), "model_ms": round(model_ms, 3),
                    "engine_ms": round(step * 1e3 - model_ms, 3),
                    "engine_share": round(1 - model_ms / (step * 1e3), 3)}
    return best


def single_stream(model: Model, tok: Tokenizer, prompt: list[int], n: int,
                  speculative: SpeculativeConfig | None = None) -> float:
    """Decode tokens/s of one sequence alone (after its prefill step), in steady state: one
    short decode first, untimed, as llama-bench warms up (right after the yardsticks' 512 MB
    copy the first decode ran 20% slower: fresh pages and cold caches)."""
    engine = Engine(model, tok, EngineConfig(speculative=speculative))
    for tokens in (min(n, 8), n):
        engine.add_request(prompt, SamplingParams(temperature=0.0, ignore_eos=True,
                                                  max_tokens=tokens))
        engine.step()  # the prefill, and the first token
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        seconds = time.perf_counter() - t0
    return (n - 1) / seconds


def batched_decode(model: Model, tok: Tokenizer, seqs: int, prompt_len: int, n: int,
                   seed: int = 0) -> float:
    """Decode tokens/s of `seqs` sequences together, prefill excluded: llama-batched-bench's
    TG figure (`-npp prompt_len -ntg n -npl seqs`). Every prompt is prefilled first (untimed),
    then the decode-only steps after the first are timed and their tokens counted."""
    rng = random.Random(seed)
    engine = Engine(model, tok, EngineConfig(max_num_seqs=seqs,
                                             max_num_batched_tokens=seqs * prompt_len))
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)
    for _ in range(seqs):
        engine.add_request([rng.randrange(100, model.config.vocab_size - 100)
                            for _ in range(prompt_len)], params)
    while engine.step().num_prefill_tokens:  # untimed: the prefill, then one decode step
        pass
    decoded, t0 = 0, time.perf_counter()
    while engine.has_unfinished():
        decoded += sum(len(u.new_token_ids) for u in engine.step().updates)
    return decoded / (time.perf_counter() - t0) if decoded else 0.0


def _load(a: argparse.Namespace) -> tuple[Model, Tokenizer]:
    if a.pack == "auto" or a.model == "stub":
        return load(a.model, device=a.device, dtype=a.dtype, quantization=a.quantization,
                    tensor_parallel_size=a.tensor_parallel_size,
                    int8_activations=a.int8_activations)
    if a.int8_activations:
        raise ConfigError("--int8-activations runs with --pack auto")
    from nanoserve.model.llama import LlamaModel
    from nanoserve.model.loader import resolve_model

    folder = resolve_model(a.model)
    dtype = getattr(torch, a.dtype)
    model = LlamaModel.from_folder(folder, a.device, dtype, pack_weights=a.pack == "on")
    return model, Tokenizer.from_folder(folder)


# The batched decode line's shape (llama-batched-bench's -npp and -ntg), and the longest
# prompt the batch-1 line takes from the workload.
_BATCHED_PROMPT, _BATCHED_OUT, _SINGLE_PROMPT = 128, 64, 32


def check(a: argparse.Namespace) -> EngineConfig:
    """What argparse cannot judge flag by flag, before a weight loads: the device, the model
    and how it shards, the KV pool, and every request of the run against the context (one
    that cannot fit fails mid-run otherwise, after minutes of work)."""
    for low, high in (("prompt_min", "prompt_max"), ("out_min", "out_max")):
        if getattr(a, low) > getattr(a, high):
            raise ConfigError(f"--{low.replace('_', '-')} {getattr(a, low)} is more than "
                              f"--{high.replace('_', '-')} {getattr(a, high)}")
    check_device(a.device)
    if a.int8_activations:
        check_int8_activations(a.model, a.tensor_parallel_size, a.device)
    cfg = EngineConfig(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                       speculative=a.speculative_config)
    context = check_model(a.model, a.dtype, a.tensor_parallel_size, cfg, a.device).max_model_len
    runs = [("--prompt-max", a.prompt_max, "--out-max", a.out_max)]
    if a.model != "stub":  # the lines below run on real weights only
        runs.append(("the batch-1 prompt", min(a.prompt_max, _SINGLE_PROMPT), "--single-tokens",
                     a.single_tokens))
        if a.batched_seqs > 0:
            runs.append(("the batched line's prompt", _BATCHED_PROMPT, "output",
                         _BATCHED_OUT))
    for prompt_name, prompt, out_name, out in runs:
        if prompt + out > context:
            raise ConfigError(f"{prompt_name} {prompt} + {out_name} {out} = {prompt + out} "
                              f"tokens: more than the model's context of {context}")
    return cfg


def run(a: argparse.Namespace) -> Figures:
    cfg = check(a)
    model, tok = _load(a)
    llm = LLM.from_parts(model, tok, cfg)
    if a.workload == "copy":
        reqs = [(tok.encode_prompt(t), a.out_max) for t in copy_prompts()]
    else:
        reqs = workload(a.seed, a.n, model.config.vocab_size, a.prompt_min, a.prompt_max,
                        a.out_min, a.out_max)
    result = _throughput_line(a, llm, model, reqs)
    if cfg.speculative is not None:
        result |= _speculative_line(llm.engine.statistics(), result)
    if a.single_tokens > 1 and a.model != "stub":
        first = reqs[0][0] if a.workload == "copy" else reqs[0][0][:_SINGLE_PROMPT]
        result |= _single_line(model, tok, first, a.single_tokens, cfg.speculative)
        if a.profile:
            o = step_overhead(model, tok, reqs[0][0][:_SINGLE_PROMPT], a.single_tokens)
            print(f"batch-1 step: {o['step_ms']:.2f} ms = model {o['model_ms']:.2f} ms + engine "
                  f"{o['engine_ms']:.2f} ms ({o['engine_share']:.1%}: scheduling, batch, "
                  f"sampling, detokenizing, stop rules)")
            result |= {f"batch1_{k}": v for k, v in o.items()}
    if a.batched_seqs > 0 and a.model != "stub":
        result |= _batched_line(model, tok, a.batched_seqs)
    print(json.dumps(result))
    return result


def _throughput_line(a: argparse.Namespace, llm: LLM, model: Model,
                     reqs: list[tuple[list[int], int]]) -> Figures:
    """The workload's run, timed, against the compute yardstick (module docstring): its
    figures, and its line printed."""
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=o) for _, o in reqs]
    peak_before = mm_flops()
    with contextlib.ExitStack() as stack:
        prof = stack.enter_context(torch.profiler.profile()) if a.profile else None
        t0 = time.perf_counter()
        outs = llm.generate([p for p, _ in reqs], params, use_tqdm=not a.quiet)
        seconds = time.perf_counter() - t0
    peak = max(peak_before, mm_flops())
    if prof is not None:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    produced = sum(len(o.token_ids) for o in outs)
    expected = sum(o for _, o in reqs)
    if produced != expected:
        raise RuntimeError(f"produced {produced} output tokens, the workload asks for {expected}")
    prompt_tokens = sum(len(p) for p, _ in reqs)
    stats = llm.engine.statistics()
    computed = stats.prefill_tokens + stats.decode_tokens  # tokens that went through the model
    flops = 2 * weight_numel(model) * computed / seconds
    kernels = getattr(model, "kernels", None)  # a LlamaModel's; None: stock ops or the stub
    isa = kernels.isa if kernels is not None else "none"
    int8 = " --int8-activations" if a.int8_activations else ""
    print(f"nanoserve ({isa} kernels, --quantization {a.quantization}{int8}): {produced} output "
          f"tokens in {seconds:.2f}s = "
          f"{produced / seconds:.1f} tok/s ({stats.steps} steps); {computed} computed tokens "
          f"at {flops / 1e9:.1f} GFLOP/s = {flops / peak:.0%} of a 2048 mm's "
          f"{peak / 1e9:.1f} GFLOP/s")
    return {
        "isa": isa,
        "quantization": a.quantization,
        "int8_activations": a.int8_activations,
        "requests": len(reqs),
        "output_tokens": produced,
        "prompt_tokens": prompt_tokens,
        "seconds": round(seconds, 3),
        "output_tokens_per_s": round(produced / seconds, 2),
        "total_tokens_per_s": round((produced + prompt_tokens) / seconds, 2),
        "steps": stats.steps,
        "preemptions": stats.preemptions,
        "computed_tokens": computed,
        "model_gflops": round(flops / 1e9, 1),
        "mm2048_gflops": round(peak / 1e9, 1),
        "fraction_of_mm_peak": round(flops / peak, 3),
    }


def _speculative_line(stats: EngineStats, run: Figures) -> Figures:
    """The run's speculative decoding: the share of proposed tokens kept, and the tokens a
    request gained a step (its own and the proposal's kept ones, over the steps it ran)."""
    spec = stats.spec
    assert spec is not None
    rate = spec.accepted_tokens / spec.draft_tokens if spec.draft_tokens else 0.0
    gained = (spec.drafts + spec.accepted_tokens) / spec.drafts if spec.drafts else 1.0
    print(f"speculative: {spec.accepted_tokens} of {spec.draft_tokens} proposed tokens kept "
          f"({rate:.0%}), by position {list(spec.accepted_per_position)}; a checked proposal "
          f"gave {gained:.2f} tokens a step; {run['output_tokens_per_s']} output tok/s")
    return {"spec_draft_tokens": spec.draft_tokens, "spec_accepted_tokens": spec.accepted_tokens,
            "spec_acceptance": round(rate, 3), "spec_tokens_per_checked_step": round(gained, 3),
            "spec_accepted_per_position": ",".join(map(str, spec.accepted_per_position))}


def _single_line(model: Model, tok: Tokenizer, prompt: list[int], tokens: int,
                 speculative: SpeculativeConfig | None = None) -> Figures:
    """Batch-1 decode against the memory-bandwidth bound (module docstring): its figures,
    and its line printed."""
    weight_bytes = model.weight_bytes()  # type: ignore[attr-defined]  # real weights
    kernels = getattr(model, "kernels", None)
    # The bound: the weights' size read once. Read where weights of that size live (a
    # model smaller than the last-level cache is read from it, at more than DRAM's speed),
    # and, for the record, from DRAM (four times the cache) and by a copy (read + write).
    # The decode first: run after the yardsticks' 350 MB of fresh pages, SmolLM2's decode
    # came out at 149 and 156 tok/s where runs without them gave 158-161.
    single = single_stream(model, tok, prompt, tokens, speculative)
    read = read_bandwidth(weight_bytes, kernels)
    dram = read_bandwidth(max(4 * last_level_cache_bytes(), 256 << 20), kernels)
    bw = copy_bandwidth()
    bound = read / weight_bytes
    print(f"batch 1: {single:.1f} decode tok/s; bandwidth bound {bound:.1f} tok/s "
          f"({weight_bytes / 1e6:.0f} MB of weights read at {read / 1e9:.1f} GB/s), "
          f"{single / bound:.0%} of it; reads from DRAM {dram / 1e9:.1f} GB/s, "
          f"a copy moves {bw / 1e9:.1f} GB/s")
    return {"single_decode_tokens_per_s": round(single, 2),
            "weight_mbytes": round(weight_bytes / 1e6, 1),
            "read_gbytes_per_s": round(read / 1e9, 2),
            "dram_read_gbytes_per_s": round(dram / 1e9, 2),
            "copy_gbytes_per_s": round(bw / 1e9, 2),
            "bandwidth_bound_tokens_per_s": round(bound, 2),
            "bound_over_single": round(bound / single, 2),
            "share_of_bound": round(single / bound, 3)}


def _batched_line(model: Model, tok: Tokenizer, seqs: int) -> Figures:
    """llama-batched-bench's TG on `seqs` sequences: its figures, and its line printed."""
    tg = batched_decode(model, tok, seqs, _BATCHED_PROMPT, _BATCHED_OUT)
    print(f"{seqs} sequences (128-token prompts, 64 out): {tg:.1f} decode tok/s, "
          f"prefill excluded")
    return {"batched_decode_tokens_per_s": round(tg, 2), "batched_seqs": seqs}
