"""`sim validate`: the real engine on a load, measured, beside what the simulator predicts.

The measured side (sim/capacity/measured.py) runs the real model through the same bridge the
server uses (AsyncEngine with the live clock: steps in a worker thread, wall-clock seconds),
with one client task per request that arrives at its at_s, streams its updates and notes when
each arrives. With `--replicas N` it is a fleet: N bridges, each over its own engine and its
own copy of the model (the model holds the replica's KV cache), in one Trio run, and every
arrival placed by `--router`'s policy object, the one the simulated fleet uses
(sim/capacity/routers.py). The predicted side runs the same workload in
`sim.capacity.fleet.simulate` with the stub model, the cost model, the same N and router. Both
sides are reduced by the same `summarize`, so a difference is the cost model's error plus the
measurement's noise, never a difference of definitions; each run also says how many requests
it placed on the replica the simulator placed them on. Before each run and after the last it
measures the machine's speed against the cost model's (sim/capacity/calibrate.py) and shows a
second prediction at that speed, so that a host running slower today than when it was
profiled is not mistaken for a simulator error.

N replicas in one process share its cores and its GIL: give --threads so that N x threads
fits the cores (N = 2 on two cores: --threads 1); the steps' wall time over their CPU time
then shows what the replicas cost each other (the simulator assumes they cost nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import statistics
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from nanoserve import flags
from nanoserve.config import EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.model.base import Model
from nanoserve.model.quant import CHOICES
from nanoserve.tokenizer import Tokenizer
from sim.capacity.acceptance import (
    MEASURED,
    acceptance,
    acceptance_arg,
    speculation_inputs,
    speculation_line,
)
from sim.capacity.calibrate import geometric_mean, scaled
from sim.capacity.cost import CostModel, load_cost_model
from sim.capacity.fleet import SimResult, simulate
from sim.capacity.measured import Measured, agreement, measure_runs
from sim.capacity.plan import default_num_blocks, flat, stub_model
from sim.capacity.profile import machine_info, set_threads, torch_threads
from sim.capacity.routers import ROUTERS
from sim.capacity.summary import summarize
from sim.cli_util import add_trace_args, engine_config, guarded, trace_options
from sim.files import atomic_write_text
from sim.load.spec import parse_load_spec
from sim.load.workload import Workload, copy_workload, file_workload, spec_workload

COMPARED = ("output_token_throughput", "request_throughput", "ttft_p50", "ttft_p90",
            "tpot_p50", "tpot_p90", "itl_p50", "e2e_p50")


def compare(predicted: dict[str, Any], runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Metric by metric: predicted, measured mean, spread (max - min over runs), error."""
    rows = []
    for m in COMPARED:
        got = [r[m] for r in runs if r[m] is not None]
        pred = predicted[m]
        if not got or pred is None:
            rows.append({"metric": m, "predicted": pred, "measured": None, "spread": None,
                         "error": None, "within": None})
            continue
        mean = statistics.fmean(got)
        spread = max(got) - min(got)
        err = (pred - mean) / mean if mean else None
        within = abs(pred - mean) <= max(0.10 * abs(mean), 2 * spread)
        rows.append({"metric": m, "predicted": pred, "measured": mean, "spread": spread,
                     "error": err, "within": within})
    return rows


def add_parser(sub: Any) -> None:
    p = sub.add_parser("validate", help="run the real engine on a load (wall clock) and "
                       "compare each metric with the simulator's prediction",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", metavar="SPEC", help="a load spec (or --trace FILE, or "
                   "--workload copy)")
    p.add_argument("--workload", choices=("copy",),
                   help="copy: speculative decoding's 36 prompts whose answers copy from "
                   "them (nanoserve/workloads.py), all at once, --copy-tokens each")
    p.add_argument("--copy-tokens", type=flags.positive_int, default=64, metavar="N",
                   help="output tokens of each --workload copy request [64]")
    p.add_argument("--acceptance", type=acceptance_arg, metavar="RATE|recorded|measured",
                   help="with --engine speculative_config=...: the plan's acceptance rate "
                   "(tokens kept over proposed, as measured by `nanoserve bench "
                   "--speculative-config`), the stub copying at the rate that gives it; "
                   "recorded: the stub says each request's tokens as the trace recorded "
                   "them; measured: as the first measured run said them "
                   "(sim/capacity/acceptance.py). The measured runs' own is shown beside")
    p.add_argument("--cost", required=True, type=flags.input_file, metavar="COST.json")
    p.add_argument("--threads", type=flags.positive_int, metavar="N",
                   help="torch CPU threads (recorded in the cost model's machine) [torch's]")
    p.add_argument("--quantization", default="auto", choices=CHOICES,
                   help="as nanoserve serve's: auto keeps a GGUF's own blocks [auto]")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--runs", type=flags.positive_int, default=3, help="measured runs [3]")
    p.add_argument("--warmup", type=flags.fraction, default=0.0,
                   help="fraction of requests left out of the metrics [0]")
    p.add_argument("--engine", nargs="+", action="extend", default=[], metavar="KEY=VALUE")
    p.add_argument("--replicas", type=flags.positive_int, default=1,
                   help="a fleet of N engines in one process, each with its own model [1]")
    p.add_argument("--router", choices=ROUTERS, default="round_robin",
                   help="how the fleet places arrivals, measured and simulated alike "
                   "[round_robin]")
    p.add_argument("--out", type=flags.output_file, metavar="JSON",
                   help="also write the comparison as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar (shown on a terminal)")
    p.add_argument("--report", type=flags.output_file, metavar="FILE",
                   help="write the calibration report (the load, the engine, the machine, "
                   "the table, each run's speed and contention) as text to keep beside the "
                   "cost model")
    add_trace_args(p)
    p.set_defaults(main=guarded(_checked))


def _checked(a: argparse.Namespace) -> int:
    """`--engine` judged before anything loads or runs (one line, exit 2, if it is bad)."""
    engine_config(a.engine)
    return run_validate(a)


def simulated(workload: Workload, cost: CostModel, tokenizer: Any, config: EngineConfig,
              replicas: int = 1, router: str = "round_robin", copy_prob: float = 0.0,
              outputs: Mapping[tuple[int, ...], Sequence[int]] | None = None) -> SimResult:
    """The simulator's run of `workload`: stub engines (the stub keeps no KV, so the
    replicas share one; it copies `copy_prob` of its tokens, and says `outputs` after their
    prompts), the cost model's step durations."""
    model = stub_model(tokenizer, config, copy_prob, outputs)
    return simulate(workload.requests, lambda: Engine(model, tokenizer, config), cost,
                    replicas=replicas, router=router)


def predict(workload: Workload, cost: CostModel, tokenizer: Any, config: EngineConfig,
            warmup: float, replicas: int = 1, router: str = "round_robin",
            copy_prob: float = 0.0,
            outputs: Mapping[tuple[int, ...], Sequence[int]] | None = None) -> dict[str, Any]:
    result = simulated(workload, cost, tokenizer, config, replicas, router, copy_prob,
                       outputs)
    return summarize(result, warmup=warmup, slo=None, num_blocks=config.num_blocks or 1,
                     replicas=replicas)


# The flags a --report's command line gives when they differ from these (their defaults).
_REPORT_DEFAULTS = {"trace_format": None, "start": 0.0, "duration": None, "speedup": 1.0,
                    "trace_seed": 0, "threads": None, "quantization": "auto", "warmup": 0.0}


def run_validate(a: argparse.Namespace) -> int:
    if a.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {a.replicas}")
    if sum(x is not None for x in (a.load, a.trace, a.workload)) != 1:
        raise ValueError("give --load SPEC, --trace FILE or --workload copy (one of them)")
    set_threads(a.threads)
    cost = load_cost_model(a.cost)
    base = engine_config(a.engine)
    config = dataclasses.replace(base, num_blocks=default_num_blocks(cost, base))
    models, tok = _models(a)
    workload = (spec_workload(parse_load_spec(a.load), tok, tok.vocab_size) if a.load else
                copy_workload(tok, a.copy_tokens) if a.workload else
                file_workload(a.trace, tok, **trace_options(a)))
    given = speculation_inputs(a.acceptance, workload, cost, tok, config)
    copy_prob, outputs = given.copy_prob, given.outputs
    # Under --acceptance measured the stub says what the first measured run said, so the
    # simulation comes after the runs (and the placements are held against it then).
    sim = None if a.acceptance == MEASURED else simulated(
        workload, cost, tok, config, a.replicas, a.router, copy_prob, outputs)
    measured = measure_runs(workload, models, tok, cost, config, sim, runs=a.runs,
                            router=a.router, warmup=a.warmup, quiet=a.quiet)
    if sim is None:
        said = measured.outputs
        outputs = {r.prompt_ids: tuple(said[r.id]) for r in workload.requests if r.id in said}
        sim = simulated(workload, cost, tok, config, a.replicas, a.router, copy_prob, outputs)
        measured.placed = [agreement(sim, r) for r in measured.results]
    predicted = flat(summarize(sim, warmup=a.warmup, slo=None,
                               num_blocks=config.num_blocks or 1, replicas=a.replicas))
    speed = geometric_mean(measured.speeds)
    rows = compare(predicted, measured.runs)
    rows_now = compare(flat(predict(workload, scaled(cost, speed), tok, config, a.warmup,
                                    a.replicas, a.router, copy_prob, outputs)), measured.runs)
    head = _head(a, workload.source, cost.name, measured)
    if config.speculative is not None:
        head += "\n" + speculation_line(a.acceptance, copy_prob, sim, measured.acceptance)
    text = head + "\n" + calibration_table(rows, rows_now, speed, measured.speeds)
    print(text)
    if a.report:
        atomic_write_text(a.report, _report(a, config, text, measured))
    if a.out:
        atomic_write_text(a.out, json.dumps({
            "load": workload.source, "model": a.model, "replicas": a.replicas,
            "router": a.router, "cost_model": cost.name, "predicted": predicted,
            "runs": measured.runs, "contention": measured.contention, "steal": measured.steal,
            "machine_speed": measured.speeds, "placement_agreement": measured.placed,
            "acceptance": {"asked": a.acceptance, "copy_prob": copy_prob,
                           "simulated": acceptance(sim), "measured": measured.acceptance},
            "compare": rows, "compare_at_speed": rows_now}, indent=1) + "\n")
    return 0


def _models(a: argparse.Namespace) -> tuple[list[Model], Tokenizer]:
    """One model object per replica (each engine allocates its KV cache in its model), and
    the tokenizer."""
    from nanoserve.model import load

    model, tok = load(a.model, quantization=a.quantization)
    models = [model] + [load(a.model, quantization=a.quantization)[0]
                        for _ in range(a.replicas - 1)]
    cores = os.cpu_count() or 1
    if a.replicas * torch_threads() > cores:
        print(f"note: {a.replicas} replicas x {torch_threads()} torch threads > {cores} cores: "
              "the replicas will slow each other down (give --threads)", file=sys.stderr)
    return models, tok


def _head(a: argparse.Namespace, source: str, cost_name: str, measured: Measured) -> str:
    """The report's first lines: the load, the runs' contention and steal, the placements."""
    known = [s for s in measured.steal if s is not None]
    fleet = f"{a.replicas} replicas, router {a.router}; " if a.replicas > 1 else ""
    head = (f"load {source} on {a.model}; {fleet}cost model {cost_name}; {a.runs} runs; "
            f"steps took {statistics.fmean(measured.contention):.2f}x their CPU time "
            "(1 = idle cores)"
            + (f"; host steal {statistics.fmean(known):.0%} of a CPU" if known else ""))
    if a.replicas > 1:
        head += ("\nplaced on the simulator's replica: "
                 + " ".join(f"{p:.0%}" for p in measured.placed))
    return head


def _report(a: argparse.Namespace, config: EngineConfig, text: str,
            measured: Measured) -> str:
    """--report's text: the command line that reruns it, the engine, the machine, the table
    and each run's speed and contention."""
    runs = "\n".join(
        f"run {k + 1}: contention {c:.2f}x, machine speed x{measured.speeds[k]:.3f} before, "
        f"x{measured.speeds[k + 1]:.3f} after" for k, c in enumerate(measured.contention))
    # Every flag that changes the measurement and is not at its default, so the line
    # reruns it (the trace's flags are at their defaults under --load).
    given = (f"--load {a.load}" if a.load else
             f"--workload copy --copy-tokens {a.copy_tokens}" if a.workload else
             f"--trace {a.trace}")
    given += "" if a.acceptance is None else f" --acceptance {a.acceptance}"
    given += "".join(f" --{k.replace('_', '-')} {getattr(a, k)}"
                     for k, d in _REPORT_DEFAULTS.items() if getattr(a, k) != d)
    given += " --ignore-prefixes" if a.ignore_prefixes else ""
    given += f" --replicas {a.replicas} --router {a.router}" if a.replicas > 1 else ""
    given += "".join(f" --engine {shlex.quote(e)}" for e in a.engine)
    return (f"sim validate {given} --cost {a.cost} --model {a.model} --runs {a.runs}\n"
            f"engine: {config}\nmachine: {json.dumps(machine_info())}\n{text}\n{runs}\n")


def calibration_table(rows: list[dict[str, Any]], rows_now: list[dict[str, Any]],
                      speed: float, speeds: list[float]) -> str:
    """Predicted against measured for every compared metric, at the cost model's speed and
    at the machine's speed measured during the runs."""
    out: list[str] = []
    out.append(f"machine speed against the cost model: x{speed:.3f} ("
               + " ".join(f"{s:.3f}" for s in speeds) + "; > 1: slower than when profiled); "
               f"'at x{speed:.3f}' predicts with the cost model scaled by it")
    out.append(f"{'metric':>24} {'predicted':>10} {'measured':>10} {'spread':>9} {'error':>8}"
               f"      {f'at x{speed:.3f}':>10} {'error':>8}")
    def error(e: float | None) -> str:  # None: a measured 0 (ITL inside one update)
        return f"{'-':>8}" if e is None else f"{e:>+8.1%}"

    for r, n in zip(rows, rows_now, strict=True):
        if r["measured"] is None:
            out.append(f"{r['metric']:>24} {'-':>10} {'-':>10}")
            continue
        out.append(f"{r['metric']:>24} {r['predicted']:>10.4g} {r['measured']:>10.4g} "
                   f"{r['spread']:>9.3g} {error(r['error'])}{'' if r['within'] else ' OUT':4} "
                   f" {n['predicted']:>10.4g} {error(n['error'])}"
                   f"{'' if n['within'] else ' OUT'}")
    return "\n".join(out)
