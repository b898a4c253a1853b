"""`sim profile`: measure the real engine's step time over a grid and fit the cost model.

What is timed is a whole `Engine.step()` (schedule, forward, sample, detokenize, update),
since that is what a step costs a server. A grid point is (D decoding sequences at context
C, plus one fresh prompt of P tokens). Each (D, C) cell has its own engine, whose D
sequences are prefilled first (not timed) and take a few warm-up steps; then, `reps`
times, every cell in turn takes one untimed step and the steps that decode its D rows and
prefill a new prompt of each size P (max_tokens 1, so it leaves at once; the prefix cache
is off, so nothing is reused), timed; the median over reps is kept. Contexts grow by one
token per step, which the features record exactly. The prompt-only cell also times the
last chunk of long prompts (`chunk_offsets`: a 512-token chunk after 1024, 2048 and 3072
tokens), a chunked prefill's step, whose attention reads cached keys (cost.py's
prefill_cached_pairs) that fresh prompts never have.

The fit is checked before it is trusted: a seeded quarter of the grid points is held out,
the model is fitted on the rest, and its relative error on the held-out points is printed
(and stored in the JSON). The saved coefficients are then fitted on all points.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from nanoserve import flags
from nanoserve.config import EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.engine.outputs import StepResult
from nanoserve.model.base import Model
from nanoserve.model.quant import CHOICES
from nanoserve.progress import bar
from nanoserve.sampling.params import SamplingParams
from nanoserve.tokenizer import Tokenizer
from sim.capacity.cost import FEATURES, CostModel, fit_coefficients, relative_errors, step_features
from sim.cli_util import guarded

# Decode rows, their context, prompt tokens. Sized for a 2-core CPU: about nine minutes
# for SmolLM2 on one thread.
# Five prefill sizes: the cost is fitted in P, P² (attention) and whether P > 0, and a
# held-out point must not be the one that pins a coefficient. Decode counts 1 and 2 both,
# because a step is not linear there: one row multiplies by the weights as a gemv, two or
# more as a packed gemm (measured, one thread: 60 ms at 1 row, 75-90 ms at 2-4, 95-110 ms
# at 8), which the cost model's `batched` term prices; one row with no prompt is the only
# point where it is 0, so it is measured at every context.
# Decode 16 is one pass over the weights' panels where 32 and 33 rows (32 decoding + a
# prompt) are two and three: what separates a row's cost from a pass's (cost.py).
GRID = {"decode": (0, 1, 2, 4, 8, 16, 32), "context": (32, 256, 640),
        "prefill": (0, 32, 96, 224, 448), "chunk_offsets": (1024, 2048, 3072)}
QUICK_GRID = {"decode": (0, 1, 6), "context": (16, 48), "prefill": (0, 8, 24, 40)}


@dataclass(frozen=True, slots=True)
class Measured:
    decode: int
    context: int
    prefill: int
    features: tuple[float, ...]  # of the median step
    seconds: float  # median over reps


def cell_engine(model: Model, tokenizer: Tokenizer, ids: Callable[[int], list[int]],
                decode: int, context: int, *, steps: int, longest: int, pmax: int,
                block_size: int, warmup: int) -> Engine:
    """The engine of one (D, C) cell: `decode` rows of `context` random prompt tokens (from
    `ids`) prefilled to their first token and stepped `warmup` times, none of it timed, in a
    pool sized for `steps` more steps of them beside a prompt of `longest` tokens."""
    d, c = decode, context
    blocks = (d * (c + steps) + longest) // block_size + 16 + d
    ctx = min(model.config.max_position_embeddings, blocks * block_size)
    config = EngineConfig(block_size=block_size, num_blocks=blocks, max_model_len=ctx,
                          max_num_seqs=d + 1, max_num_batched_tokens=max(d + pmax, 512),
                          prefix_caching=False)
    eng = Engine(model, tokenizer, config)
    # Long enough to keep decoding through every timed step of this cell.
    long = SamplingParams(temperature=0, ignore_eos=True, max_tokens=ctx - c)
    rows = {eng.add_request(ids(c), long) for _ in range(d)}
    started: set[str] = set()
    while started != rows:  # the D rows' prefill, to each row's first token: not timed
        started.update(u.request_id for u in eng.step().updates)
    for _ in range(warmup):
        eng.step()
    return eng


def measure_grid(model: Model, tokenizer: Tokenizer, grid: Mapping[str, Sequence[int]], *,
                 reps: int = 5, warmup: int = 2, block_size: int = 16,
                 timer: Callable[[], float] = time.perf_counter,
                 log: Callable[[str], None] | None = None,
                 progress: bool = False, isa: str | None = None) -> list[Measured]:
    rng = random.Random(0)
    vocab = model.config.vocab_size

    def ids(n: int) -> list[int]:
        return [rng.randrange(1000, vocab) for _ in range(n)]

    pmax = max(grid["prefill"])
    chunk = max(pmax, 512)  # the prompt-only cell's step budget: its chunk size
    # Decode 0 has no context to vary: one cell.
    cells = [(d, c) for d in grid["decode"] for c in grid["context"][: None if d else 1]]
    engines: dict[tuple[int, int], Engine] = {}
    for d, c in cells:
        # Each visit takes one untimed step, then one timed step per prompt size.
        steps = reps * (len(grid["prefill"]) + 1) + warmup + 8
        offsets = grid.get("chunk_offsets", ()) if d == 0 else ()
        longest = max([pmax, *(o + chunk for o in offsets)])
        engines[d, c] = cell_engine(model, tokenizer, ids, d, c, steps=steps, longest=longest,
                                    pmax=pmax, block_size=block_size, warmup=warmup)
    samples: dict[tuple[int, int, int], list[tuple[float, StepResult]]] = {}
    # Rep by rep over every cell, and within a cell over the prompt sizes in turn: a shared
    # host's speed drifts by several percent over minutes, and measuring a cell's reps
    # back to back would hand that drift to the cell (measured: whole cells 8% off the fit,
    # in one direction) where interleaving spreads it over all of them as noise.
    shown = bar(reps * len(cells), "sim profile", enabled=progress, unit="cell")
    for rep in range(reps):
        for d, c in cells:
            shown.update(1)
            eng = engines[d, c]
            eng.step()  # back on this engine: one untimed step, as a server's last one
            for p in (p for p in grid["prefill"] if d or p):
                if p:
                    eng.add_request(ids(p), SamplingParams(temperature=0, max_tokens=1))
                t0 = timer()
                res = eng.step()
                samples.setdefault((d, c, p), []).append((timer() - t0, res))
            for off in grid.get("chunk_offsets", ()) if d == 0 else ():
                # A long prompt's last chunk, at context `off`: a chunked prefill's step,
                # whose attention (chunk x context pairs) fresh prompts never reach.
                eng.add_request(ids(off + chunk), SamplingParams(temperature=0, max_tokens=1))
                for _ in range(off // chunk):
                    eng.step()  # the chunks before: not timed
                t0 = timer()
                res = eng.step()
                samples.setdefault((0, off, chunk), []).append((timer() - t0, res))
        if log is not None:
            log(f"rep {rep + 1}/{reps} of {len(samples)} grid points done")
    shown.close()
    out: list[Measured] = []
    for (d, c, p), got in samples.items():
        sec, res = sorted(got, key=lambda s: s[0])[len(got) // 2]
        out.append(Measured(d, c, p, step_features(res, isa), sec))
        if log is not None:
            log(f"decode={d:3d} context={c:4d} prefill={p:4d}: {sec * 1000:8.2f} ms")
    return out


def fit_profile(points: Sequence[Measured], *, name: str, model: str,
                machine: dict[str, Any], kv_bytes_per_token: int, block_size: int,
                grid: Mapping[str, Sequence[int]]) -> CostModel:
    """Held-out check (a seeded quarter of the points), then the fit on all points."""
    use = [f for k, f in enumerate(FEATURES)
           if k == 0 or len({p.features[k] for p in points}) > 1]
    # A seeded quarter, not every fourth point: a stride would line up with a grid axis
    # and hold out every point that pins one coefficient.
    out = set(random.Random(0).sample(range(len(points)), len(points) // 4))
    held = [p for k, p in enumerate(points) if k in out]
    train = [p for k, p in enumerate(points) if k not in out]
    coef = fit_coefficients([p.features for p in train], [p.seconds for p in train], use)
    check = CostModel(coef)
    errs = relative_errors(check, [p.features for p in held], [p.seconds for p in held])
    final = fit_coefficients([p.features for p in points], [p.seconds for p in points], use)
    all_errs = relative_errors(CostModel(final), [p.features for p in points],
                               [p.seconds for p in points])
    fit = {
        "grid": {k: list(v) for k, v in grid.items()},
        "points": len(points),
        "held_out": len(held),
        "held_out_mean_rel_error": statistics.fmean(errs) if errs else None,
        "held_out_max_rel_error": max(errs) if errs else None,
        "in_sample_mean_rel_error": statistics.fmean(all_errs),
        "samples": [{"decode": p.decode, "context": p.context, "prefill": p.prefill,
                     "seconds": p.seconds} for p in points],
    }
    return CostModel(final, name=name, model=model, machine=machine,
                     kv_bytes_per_token=kv_bytes_per_token, block_size=block_size, fit=fit)


def quantized_isa(model: Model) -> str | None:
    """The instruction set of the kernels the model's quantized projections run (the cost
    model's features follow their dispatch), or None when it has none (float32 weights)."""
    from nanoserve.model.quant import QuantProj

    layers = getattr(model, "layers", None) or []
    proj = getattr(layers[0], "qkv", None) if layers else None
    return proj.kernels.isa if isinstance(proj, QuantProj) and proj.panels else None


def set_threads(n: int | None) -> None:
    """Pin torch's CPU threads (profile and validate must run the model alike)."""
    if n is not None:
        import torch

        if n < 1:
            raise ValueError(f"--threads must be >= 1, got {n}")
        torch.set_num_threads(n)


def torch_threads() -> int:
    import torch

    return int(torch.get_num_threads())


def machine_info() -> dict[str, Any]:
    import torch

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform()}


def add_parser(sub: Any) -> None:
    p = sub.add_parser("profile", help="measure the real engine's step time on this machine "
                       "and fit a step-cost model", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=flags.positive_int, metavar="N",
                   help="torch CPU threads (recorded in the cost model's machine) [torch's]")
    p.add_argument("--quantization", default="auto", choices=CHOICES,
                   help="as nanoserve serve's: auto keeps a GGUF's own blocks [auto]")
    p.add_argument("--model", default="smollm2", help="smollm2, stub, or a model path")
    p.add_argument("--out", type=flags.output_file, default="cost.json", metavar="COST.json")
    p.add_argument("--reps", type=flags.positive_int, default=5,
                   help="timed steps per grid point [5]")
    p.add_argument("--quick", action="store_true", help="a tiny grid (for smoke tests)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="time steps by the wall clock, or by this thread's CPU time (with "
                   "--threads 1: the step's cost on an idle machine, immune to other "
                   "processes sharing the cores) [wall]")
    p.add_argument("--name", help="the cost model's name [the output file's name]")
    p.add_argument("--quiet", action="store_true", help="no progress bar (shown on a terminal)")

    p.set_defaults(main=guarded(run_profile))


def run_profile(a: argparse.Namespace) -> int:
    set_threads(a.threads)
    from pathlib import Path

    from nanoserve.model import load

    model, tok = load(a.model, quantization=a.quantization)
    grid = QUICK_GRID if a.quick else GRID
    if a.clock == "cpu" and torch_threads() != 1:
        raise ValueError("--clock cpu needs --threads 1: other threads' work is not counted")
    timer = time.thread_time if a.clock == "cpu" else time.perf_counter
    # tqdm.write: the log lines go above the progress bar, not through it.
    isa = quantized_isa(model)
    points = measure_grid(model, tok, grid, reps=a.reps, timer=timer,
                          log=lambda s: tqdm.write(s, file=sys.stderr), progress=not a.quiet,
                          isa=isa)
    bs = 16
    machine = {**machine_info(), "clock": a.clock, "quantization": a.quantization,
               "isa": isa}
    cost = fit_profile(points, name=a.name or Path(a.out).name, model=a.model,
                       machine=machine, block_size=bs, grid=grid,
                       kv_bytes_per_token=model.kv_bytes_per_block(bs) // bs)
    cost.save(a.out)
    f = cost.fit
    print(f"{len(points)} grid points; held-out ({f['held_out']}) relative error: mean "
          f"{f['held_out_mean_rel_error']:.2%}, max {f['held_out_max_rel_error']:.2%}; "
          f"in-sample mean {f['in_sample_mean_rel_error']:.2%}")
    print("coefficients: " + ", ".join(f"{k}={v:.4g}" for k, v in
                                        zip(FEATURES, cost.coef, strict=True)))
    print(f"wrote {a.out}")
    return 0
