"""Command lines of `sim capacity`, `sim profile` and `sim validate` (sim/commands.py registers
them).

  sim capacity (TRACE | --trace FILE | --load SPEC) --cost COST.json [--sweep rate=1,2,4,8]
               [--sweep num_blocks=...] [--sweep max_num_seqs=...] [--slo ttft_p99=2s,...]
               [--seeds 3] [--warmup 0.1] [--replicas N --router KIND] [--max-queue N]
               [--engine k=v ...] [--acceptance RATE] [--out PREFIX] [--no-plots] [--jobs N]
               [--executor process|ray [--ray-address ADDR]]
               [--trace-format F] [--start S] [--duration S] [--speedup X] [--ignore-prefixes]
  sim profile --model smollm2 [--out COST.json] [--quick]
  sim validate (--load SPEC | --trace FILE | --workload copy) --cost COST.json [--runs 3]
               [--engine k=v ...] [--acceptance RATE] [--report FILE]

A TRACE is a nanoserve virtual-clock trace or a public one: Mooncake or Alibaba JSONL (with
prefix blocks: prompts are built to share exactly the blocks the trace says they share),
BurstGPT or Azure CSV (sim/load/public.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
from concurrent.futures import Executor
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from nanoserve import flags
from nanoserve.progress import LabelledProgress
from nanoserve.tokenizer import Tokenizer
from sim.capacity.acceptance import MEASURED, acceptance_arg, speculation_inputs
from sim.capacity.cost import load_cost_model
from sim.capacity.fleet import ROUTERS
from sim.capacity.parallel import ParallelPlanner, make_executor
from sim.capacity.plan import Plan, Planner, default_num_blocks
from sim.capacity.report import build_report, dumps_report, table, write_csv, write_plots
from sim.capacity.summary import parse_slo
from sim.cli_util import (
    ENGINE_KEYS,
    add_trace_args,
    engine_config,
    guarded,
    tokenizer,
    trace_options,
)
from sim.files import atomic_write_text
from sim.load.spec import parse_load_spec
from sim.load.workload import Workload, file_workload, spec_workload

SWEEPABLE = ("rate", "num_blocks", "max_num_seqs")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("capacity", help="sweep rates / pool sizes / batch limits on the "
                       "engine in modelled time, and search the highest rate meeting an SLO",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace_arg", nargs="?", type=flags.input_file, metavar="TRACE",
                   help="a virtual-clock trace, or a public one (as --trace)")
    p.add_argument("--load", metavar="SPEC", help="a load spec (see `sim load --help`)")
    p.add_argument("--cost", required=True, type=flags.input_file, metavar="COST.json",
                   help="from `sim profile`")
    p.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2,...",
                   help=f"sweep one of {', '.join(SWEEPABLE)} (repeatable: the grid is "
                   "their product)")
    p.add_argument("--slo", metavar="TARGETS", help="e.g. ttft_p99=2s,tpot_p99=200ms: adds "
                   "goodput and searches the highest rate that meets it")
    p.add_argument("--seeds", type=flags.positive_int, default=3,
                   help="seeds per point (load spec only) [3]")
    p.add_argument("--warmup", type=flags.fraction, default=0.1,
                   help="fraction of requests (by arrival) left out of the metrics [0.1]")
    p.add_argument("--replicas", type=flags.positive_int, default=1, help="identical servers [1]")
    p.add_argument("--router", choices=ROUTERS, default="round_robin")
    p.add_argument("--max-queue", type=flags.non_negative_int, metavar="N",
                   help="the server's --max-queue: a request beyond N waiting gets 429")
    p.add_argument("--engine", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help=f"engine settings ({', '.join(ENGINE_KEYS)})")
    p.add_argument("--acceptance", type=acceptance_arg, metavar="RATE|recorded",
                   help="with --engine speculative_config=...: the fraction of proposed "
                   "tokens kept, as `nanoserve bench --speculative-config` or /metrics "
                   "measured it (the stub copies at the rate that gives it); or recorded: "
                   "the stub says each request's tokens as the trace recorded them "
                   "(sim/capacity/acceptance.py) [the stub's own tokens]")
    p.add_argument("--search-start", type=flags.positive_float, metavar="RATE",
                   help="first rate the SLO search tries [the highest swept rate meeting it]")
    p.add_argument("--out", default="capacity", metavar="PREFIX",
                   help="writes PREFIX.json, PREFIX.csv, PREFIX.latency.png, "
                   "PREFIX.timeline.png [capacity]")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--tokenizer", default="smollm2", metavar="MODEL")
    p.add_argument("--quiet", action="store_true", help="no progress bar (shown on a terminal)")
    p.add_argument("--jobs", type=flags.positive_int, default=1, metavar="N",
                   help="runs (one seed at one point) in N processes at once; the report is "
                   "the same byte for byte [1]")
    add_trace_args(p)
    p.add_argument("--executor", choices=("process", "ray"), default="process",
                   help="where --jobs run: local processes, or Ray (a local instance of "
                   "--jobs CPUs, or the cluster at --ray-address) [process]")
    p.add_argument("--ray-address", metavar="ADDR",
                   help="a Ray cluster to run on (auto, ray://HEAD:10001, HOST:6379)")
    p.set_defaults(main=guarded(run_capacity))


def parse_sweeps(items: list[str]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for item in items:
        key, eq, values = item.partition("=")
        if not eq or key not in SWEEPABLE:
            raise ValueError(f"--sweep takes {'|'.join(SWEEPABLE)}=V1,V2,..., got {item!r}")
        if key in out:
            raise ValueError(f"--sweep {key} given twice")
        try:
            vals = [float(v) for v in values.split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"--sweep {key}: values must be numbers, got {values!r}") from None
        if not vals or not all(0 < v < math.inf for v in vals):  # NaN fails both
            raise ValueError(f"--sweep {key}: needs finite values > 0, got {values!r}")
        if key != "rate" and any(v != int(v) for v in vals):
            raise ValueError(f"--sweep {key}: values must be integers, got {values!r}")
        out[key] = vals
    return out


def run_capacity(a: argparse.Namespace) -> int:
    if a.trace_arg is not None and a.trace is not None:
        raise ValueError("give the trace once: TRACE or --trace FILE")
    a.trace = a.trace or a.trace_arg
    if (a.trace is None) == (a.load is None):
        raise ValueError("give a TRACE or --load SPEC (one of them)")
    if a.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {a.jobs}")
    cost = load_cost_model(a.cost)
    engine = engine_config(a.engine)
    sweeps = parse_sweeps(a.sweep)
    slo = parse_slo(a.slo) if a.slo else None
    plan = Plan(engine, a.replicas, a.router, a.max_queue, a.warmup, slo)
    tok = tokenizer(a.tokenizer)
    if a.load is not None:
        spec = parse_load_spec(a.load)
        seeds = [spec.seed + k for k in range(max(a.seeds, 1))]
        workloads = [spec_workload(dataclasses.replace(spec, seed=s), tok, tok.vocab_size)
                     for s in seeds]
    else:
        seeds = [0]
        workloads = [file_workload(a.trace, tok, **trace_options(a))]
    if a.acceptance == MEASURED:
        raise ValueError("--acceptance measured is sim validate's (its measured runs)")
    given = speculation_inputs(a.acceptance, workloads[0], cost, tok, engine)
    rate = a.acceptance if given.fit is not None else None  # not a word
    plan = dataclasses.replace(plan, acceptance=rate, copy_prob=given.copy_prob,
                               fit_acceptance=given.fit, recorded=given.outputs is not None)
    if given.fit is not None:
        print(f"speculation: acceptance {a.acceptance:.3f} asked, {given.fit:.3f} simulated "
              f"(the stub copies {given.copy_prob:.3f} of its tokens)")
    pool = make_executor(a.executor, a.jobs, a.ray_address)
    with pool if pool is not None else nullcontext(None) as executor:
        progress = LabelledProgress(enabled=not a.quiet,
                                    unit="request" if executor is None else "run")
        report = plan_capacity(workloads, seeds, cost, plan, tok, sweeps, a.search_start,
                               progress=progress, plots=not a.no_plots, out=Path(a.out),
                               executor=executor, tokenizer_name=a.tokenizer)
    print(table(report))
    print(f"wrote {a.out}.json, {a.out}.csv" + ("" if a.no_plots else
          f", {a.out}.latency.png, {a.out}.timeline.png"))
    return 0


def plan_capacity(workloads: list[Workload], seeds: list[int], cost: Any, plan: Plan,
                  tok: Tokenizer, sweeps: dict[str, list[float]], search_start: float | None,
                  *, progress: Any = None, plots: bool = False, out: Path | None = None,
                  executor: Executor | None = None, tokenizer_name: str | None = None
                  ) -> dict[str, Any]:
    """The whole run: every grid point, the SLO searches, the report (and its files).
    With an `executor`, the runs are its tasks (parallel.py), and workers load the tokenizer
    by `tokenizer_name` if given; the report is the same as without."""
    rates: list[float | None] = list(sweeps.get("rate", [None]))
    blocks = [int(b) for b in sweeps.get("num_blocks", [default_num_blocks(cost, plan.engine)])]
    seqs = [int(s) for s in sweeps.get("max_num_seqs", [plan.engine.max_num_seqs])]
    planner: Planner
    if executor is None:
        planner = Planner(workloads, cost, plan, tok, progress)
    else:
        planner = ParallelPlanner(workloads, cost, plan, tok, executor,
                                  tokenizer_name=tokenizer_name, progress=progress)
        planner.prefetch([(rate, nb, ms) for nb, ms, rate in
                          itertools.product(blocks, seqs, rates)])
    points, timelines = [], []
    for nb, ms, rate in itertools.product(blocks, seqs, rates):
        points.append(planner.point(rate, nb, ms))
        _, first = planner.run(rate, nb, ms)
        timelines.append((f"rate={points[-1]['rate']:.3g} blocks={nb} seqs={ms}", first))
    searches = []
    if plan.slo is not None:
        for nb, ms in itertools.product(blocks, seqs):
            start = search_start
            if start is None:
                met = [p["rate"] for p in points if p["num_blocks"] == nb
                       and p["max_num_seqs"] == ms and p["meets_slo"]]
                start = max(met) if met else min(p["rate"] for p in points)
            searches.append(planner.search(nb, ms, start))
    report = build_report(cost=cost, plan=plan, source=workloads[0].source, seeds=seeds,
                          points=points, searches=searches, invalid=workloads[0].invalid,
                          trace=workloads[0].trace)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(f"{out}.json", dumps_report(report))
        write_csv(points, Path(f"{out}.csv"))
        if plots:
            write_plots(points, timelines, out, cost.name)
    return report
