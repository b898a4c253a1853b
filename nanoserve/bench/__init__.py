"""`nanoserve bench`: the offline throughput benchmark, on the workload hf_peer.py uses.

The workload is built exactly as ../shared/bench/hf_peer.py builds it (same seeded
generator, same draws in the same order), so the two programs' figures compare like for
like: greedy, EOS ignored, every request yields exactly its drawn output length.

Absolute figures on a shared CPU drift with whatever else runs, so every figure comes with
a yardstick measured in the same process: the compute throughput against a 2048 x 2048
float32 `torch.mm` (the fraction of that peak the whole run sustains, counting 2 FLOP per
weight per computed token, prompt and output), and batch-1 decode against the
memory-bandwidth bound (every weight read once per token, at the speed the kernels' own
threads read a buffer of the weights' size, measured right after it, again in rounds of a
read and a decode, decode.shares_of_bound, and step by step, a read beside each decode step,
decode.paired_shares). The mm is timed
before and after the run and the faster taken: one timing in a slow minute once came out
at half speed, which made the run look twice as good. `--pack off` runs the same workload
without pre-packed weights, for an old-versus-new comparison.

Two more lines measure what llama.cpp's benchmarks measure, for a side by side on the same
terms (sim/bench/llamacpp.py): batch-1 decode (`llama-bench -n`), and 16 sequences of
128-token prompts decoding 64 tokens with the prefill excluded (`llama-batched-bench`'s TG).
The first line names the instruction set the kernels run (NANOSERVE_ISA forces one).

    __init__.py    run(): the checks, the load, the workload's run and every line's report
    args.py        the command's flags, and the workload they draw (hf_peer.py's)
    yardsticks.py  what the figures are measured against: mm FLOP/s, read and copy speed
    decode.py      batch-1 and batched decode, and a batch-1 step's engine overhead
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from nanoserve.bench.args import add_args as add_args  # cli.py's
from nanoserve.bench.args import workload
from nanoserve.bench.decode import (
    Figures,
    batched_decode,
    paired_shares,
    shares_of_bound,
    single_stream,
    step_overhead,
)
from nanoserve.bench.yardsticks import (
    copy_bandwidth,
    mm_flops,
    read_bandwidth,
    reader,
    weight_numel,
)
from nanoserve.config import ConfigError, EngineConfig, SpeculativeConfig
from nanoserve.engine.outputs import EngineStats
from nanoserve.llm import LLM
from nanoserve.model import LoadOptions, Model, load
from nanoserve.model.preflight import check_device, check_int8_activations, check_model
from nanoserve.sampling.params import SamplingParams
from nanoserve.tokenizer import Tokenizer
from nanoserve.workloads import copy_prompts


def _load(a: argparse.Namespace) -> tuple[Model, Tokenizer]:
    if a.pack == "auto" or a.model == "stub":
        return load(a.model, LoadOptions(
            device=a.device, dtype=a.dtype, quantization=a.quantization,
            tensor_parallel_size=a.tensor_parallel_size, int8_activations=a.int8_activations))
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
_ROUNDS = 4  # the batch-1 share's rounds of a read and a decode


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
    read_weights = reader(weight_bytes, kernels)
    read = read_weights(5)
    dram = read_bandwidth(max(4 * last_level_cache_bytes(), 256 << 20), kernels)
    bw = copy_bandwidth()
    bound = read / weight_bytes
    # The share again, read and decode side by side in rounds (shares_of_bound): the figure
    # above sets one timing against the other, taken a minute apart.
    n = max(tokens // _ROUNDS, 8)
    shares = sorted(shares_of_bound(model, tok, prompt, weight_bytes, read_weights, _ROUNDS, n,
                                    speculative))
    median = statistics.median(shares)
    print(f"batch 1: {single:.1f} decode tok/s; bandwidth bound {bound:.1f} tok/s "
          f"({weight_bytes / 1e6:.0f} MB of weights read at {read / 1e9:.1f} GB/s), "
          f"{single / bound:.0%} of it; {median:.0%} ({shares[0]:.0%}-{shares[-1]:.0%}) in "
          f"{_ROUNDS} rounds of a read and {n} tokens; reads from DRAM {dram / 1e9:.1f} GB/s, "
          f"a copy moves {bw / 1e9:.1f} GB/s")
    paired = _paired_line(model, tok, prompt, weight_bytes, read_weights, tokens, speculative)
    return {"single_decode_tokens_per_s": round(single, 2),
            "weight_mbytes": round(weight_bytes / 1e6, 1),
            "read_gbytes_per_s": round(read / 1e9, 2),
            "dram_read_gbytes_per_s": round(dram / 1e9, 2),
            "copy_gbytes_per_s": round(bw / 1e9, 2),
            "bandwidth_bound_tokens_per_s": round(bound, 2),
            "bound_over_single": round(bound / single, 2),
            "share_of_bound": round(single / bound, 3),
            "share_of_bound_by_round": ",".join(f"{v:.3f}" for v in shares),
            "share_of_bound_median_round": round(median, 3), **paired}


def _paired_line(model: Model, tok: Tokenizer, prompt: list[int], weight_bytes: int,
                 read: Callable[[int], float], tokens: int,
                 speculative: SpeculativeConfig | None) -> Figures:
    """The batch-1 share step by step (decode.paired_shares), its line printed: the bound's
    seconds over the decode's, summed over the steps, and the middle half of the steps'
    own shares. Not measured where the weights fit in the last-level cache but not beside
    a buffer of their size: a read between steps would evict them."""
    cache = last_level_cache_bytes()
    if cache and weight_bytes <= cache < 2 * weight_bytes:
        print(f"batch 1, step by step: not measured ({weight_bytes / 1e6:.0f} MB of weights "
              f"fit in the {cache >> 20} MiB last-level cache, but not beside a read of "
              "their size)")
        return {}
    pairs = paired_shares(model, tok, prompt, weight_bytes, read, tokens, speculative)
    share = sum(b for b, _ in pairs) / sum(s for _, s in pairs)
    steps = [b / s for b, s in pairs]
    q1, _, q3 = statistics.quantiles(steps, n=4) if len(steps) > 1 else steps * 3
    print(f"batch 1, step by step: {share:.0%} of the bound over {len(pairs)} steps, each "
          f"beside a read of the weights' size (the middle half of steps {q1:.0%}-{q3:.0%})")
    return {"share_of_bound_paired": round(share, 3),
            "share_of_bound_paired_quartiles": f"{q1:.3f},{q3:.3f}"}


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size (Linux's sysfs: "32768K"), or 0 where it does not tell:
    the batch-1 line reads DRAM through a buffer four times its size."""
    sizes = [0]
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            text = f.read_text(encoding="ascii").strip()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[text[-1]] if text[-1] in "KMG" else 1
            sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes)


def _batched_line(model: Model, tok: Tokenizer, seqs: int) -> Figures:
    """llama-batched-bench's TG on `seqs` sequences: its figures, and its line printed."""
    tg = batched_decode(model, tok, seqs, _BATCHED_PROMPT, _BATCHED_OUT)
    print(f"{seqs} sequences (128-token prompts, 64 out): {tg:.1f} decode tok/s, "
          f"prefill excluded")
    return {"batched_decode_tokens_per_s": round(tg, 2), "batched_seqs": seqs}
