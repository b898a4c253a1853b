"""`sim validate`: the real engine on a load, measured, beside what the simulator predicts.

The measured side runs the real model through the same bridge the server uses (AsyncEngine
with the live clock: steps in a worker thread, wall-clock seconds), with one client task per
request that arrives at its at_s, streams its updates and notes when each arrives. The
predicted side runs the same workload in `sim.capacity.fleet.simulate` with the stub model and the
cost model. Both sides are reduced by the same `summarize`, so a difference is the cost
model's error plus the measurement's noise, never a difference of definitions. Before each
run and after the last it measures the machine's speed against the cost model's
(sim/capacity/calibrate.py) and shows a second prediction at that speed, so that a host running
slower today than when it was profiled is not mistaken for a simulator error.

`drive_bridge` works under any clock: under the virtual clock (trio.testing.MockClock) it is
the slow, Trio path that tests/test_capacity_fleet.py holds the fast engine-level loop to.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import trio

from nanoserve.config import EngineConfig
from nanoserve.engine import Engine
from nanoserve.model.quant import CHOICES
from nanoserve.model.stub import StubModel
from nanoserve.outputs import StepResult
from nanoserve.progress import bar
from nanoserve.sampling import ParamError, SamplingParams
from nanoserve.serving import AsyncEngine
from nanoserve.serving.clock import LiveClock, Step
from sim.capacity.calibrate import geometric_mean, machine_speed, scaled, steal_seconds
from sim.capacity.cost import CostModel, load_cost_model
from sim.capacity.fleet import Record, SimResult, simulate
from sim.capacity.metrics import summarize
from sim.capacity.plan import default_num_blocks, flat
from sim.capacity.profile import set_threads
from sim.cli_util import engine_config, guarded
from sim.load.spec import parse_load_spec
from sim.load.workload import SimRequest, Workload, spec_workload

# Steps that took this much longer than their CPU time, or a host that stole this fraction
# of a CPU, mark a run as measured on a busy host: its figures are flagged.
DISTURBED_WAIT = 1.10
DISTURBED_STEAL = 0.10

COMPARED = ("output_token_throughput", "request_throughput", "ttft_p50", "ttft_p90",
            "tpot_p50", "tpot_p90", "itl_p50", "e2e_p50")


async def drive_bridge(requests: Sequence[SimRequest], bridge: AsyncEngine,
                       max_queue: int | None = None,
                       on_done: Callable[[], object] | None = None) -> list[Record]:
    """Every request as a client of `bridge`, from now; records in trio's clock, from now.
    `on_done` is called as each client ends (a progress bar)."""
    t0 = trio.current_time()
    records = [Record(r.id, r.at_s, len(r.prompt_ids), replica=0) for r in requests]

    async def client(req: SimRequest, rec: Record) -> None:
        await _client(bridge, req, rec, t0, max_queue)
        if on_done is not None:
            on_done()

    async with trio.open_nursery() as nursery:
        for req, rec in zip(requests, records, strict=True):
            nursery.start_soon(client, req, rec)
    return records


async def _client(bridge: AsyncEngine, req: SimRequest, rec: Record, t0: float,
                  max_queue: int | None) -> None:
    await trio.sleep_until(t0 + req.at_s)
    if max_queue is not None:
        s = bridge.statistics()
        if s.queued + s.waiting + 1 > max_queue:
            rec.status = "rejected"
            return
    try:
        prepared = bridge.prepare(list(req.prompt_ids), req.params)
    except ParamError:
        rec.status = "invalid"
        return
    if req.stream and req.hangup_after_frames == 0:
        rec.status = "aborted"
        return
    async with bridge.stream(prepared, request_id=req.id) as stream:
        async for u in stream:
            now = trio.current_time() - t0
            rec.observe(u, now)
            if u.finished:
                return
            if req.stream and req.hangup_after_frames is not None \
                    and rec.frames >= req.hangup_after_frames:
                rec.status = "aborted"  # leaving `async with` aborts it at the next boundary
                rec.finish_s = now
                return


class _TimedLiveClock(LiveClock):
    """The live clock, adding up each step's wall and CPU time in the step's own thread."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    async def run_step(self, step: Step) -> StepResult:
        def timed() -> StepResult:
            w0, c0 = time.perf_counter(), time.thread_time()
            try:
                return step()
            finally:
                self.wall += time.perf_counter() - w0
                self.cpu += time.thread_time() - c0

        return await super().run_step(timed)


def measure(workload: Workload, engine: Engine,
            progress: str | None = None) -> tuple[SimResult, float]:
    """One wall-clock run of the workload on `engine` (real weights) via the live clock,
    and the steps' contention: their wall time over their thread's CPU time (1 on an idle
    machine with one torch thread; more when other processes share the cores). `progress`:
    a bar with that label over the requests, on a terminal."""
    clock = _TimedLiveClock()

    async def main() -> list[Record]:
        async with AsyncEngine.open(engine, clock) as bridge:
            # One throwaway request first: the first steps pay for lazy initialisation.
            warm = bridge.prepare([1000] * 8, SamplingParams(temperature=0, max_tokens=2))
            await bridge.generate(warm)
            return await drive_bridge(workload.requests, bridge, on_done=lambda: shown.update(1))

    shown = bar(len(workload.requests), progress or "", enabled=progress is not None,
                unit="request")
    try:
        records = trio.run(main)
    finally:
        shown.close()
    end = max((r.finish_s or 0.0 for r in records), default=0.0)
    contention = clock.wall / clock.cpu if clock.cpu else 1.0
    return SimResult(tuple(records), (), (engine.statistics(),), end), contention


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
    p.add_argument("--load", required=True, metavar="SPEC")
    p.add_argument("--cost", required=True, metavar="COST.json")
    p.add_argument("--threads", type=int, metavar="N",
                   help="torch CPU threads (recorded in the cost model's machine) [torch's]")
    p.add_argument("--quantization", default="auto", choices=CHOICES,
                   help="as nanoserve serve's: auto keeps a GGUF's own blocks [auto]")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--runs", type=int, default=3, help="measured runs [3]")
    p.add_argument("--warmup", type=float, default=0.0,
                   help="fraction of requests left out of the metrics [0]")
    p.add_argument("--engine", nargs="+", action="extend", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", metavar="JSON", help="also write the comparison as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar (shown on a terminal)")

    p.set_defaults(main=guarded(run_validate))


def predict(workload: Workload, cost: CostModel, tokenizer: Any, config: EngineConfig,
            warmup: float) -> dict[str, Any]:
    model = StubModel(tokenizer)
    result = simulate(workload.requests, lambda: Engine(model, tokenizer, config), cost)
    return summarize(result, warmup=warmup, slo=None, num_blocks=config.num_blocks or 1)


def run_validate(a: argparse.Namespace) -> int:
    set_threads(a.threads)
    from nanoserve.model import load

    cost = load_cost_model(a.cost)
    base = engine_config(a.engine)
    config = dataclasses.replace(base, num_blocks=default_num_blocks(cost, base))
    model, tok = load(a.model, quantization=a.quantization)
    workload = spec_workload(parse_load_spec(a.load), tok, tok.vocab_size)
    predicted = flat(predict(workload, cost, tok, config, a.warmup))
    runs: list[dict[str, Any]] = []
    contentions: list[float] = []
    steals: list[float | None] = []
    # The machine's speed against the cost model's before each run and after the last
    # (sim/capacity/calibrate.py): what tells the host's drift apart from the model's error.
    speeds = [machine_speed(model, tok, cost)]
    for k in range(a.runs):
        steal0, t0 = steal_seconds(), time.perf_counter()
        label = None if a.quiet else f"sim validate: run {k + 1}/{a.runs}"
        result, contention = measure(workload, Engine(model, tok, config), label)
        steal1, wall = steal_seconds(), time.perf_counter() - t0
        steals.append(None if steal0 is None or steal1 is None else (steal1 - steal0) / wall)
        contentions.append(contention)
        speeds.append(machine_speed(model, tok, cost))
        runs.append(flat(summarize(result, warmup=a.warmup, slo=None,
                                   num_blocks=config.num_blocks or 1)))
        print(f"run {k + 1}/{a.runs}: {runs[-1]['output_token_throughput']:.1f} tok/s, "
              f"ttft p50 {runs[-1]['ttft_p50']}, tpot p50 {runs[-1]['tpot_p50']}, "
              f"steps took {contention:.2f}x their CPU time, machine speed "
              f"x{speeds[-2]:.3f} before, x{speeds[-1]:.3f} after", file=sys.stderr, flush=True)
        if contention > DISTURBED_WAIT or (steals[-1] or 0.0) > DISTURBED_STEAL:
            print(f"run {k + 1}: disturbed: the steps waited {contention - 1:.0%} beyond their "
                  f"CPU time, the host stole {steals[-1] or 0.0:.0%} of a CPU; its wall-clock "
                  "figures say as much about the host as about the model", file=sys.stderr,
                  flush=True)
    speed = geometric_mean(speeds)
    now = scaled(cost, speed)
    rows = compare(predicted, runs)
    rows_now = compare(flat(predict(workload, now, tok, config, a.warmup)), runs)
    known = [s for s in steals if s is not None]
    print(f"load {workload.source} on {a.model}; cost model {cost.name}; {a.runs} runs; "
          f"steps took {statistics.fmean(contentions):.2f}x their CPU time (1 = idle cores)"
          + (f"; host steal {statistics.fmean(known):.0%} of a CPU" if known else ""))
    print(f"machine speed against the cost model: x{speed:.3f} (" +
          " ".join(f"{s:.3f}" for s in speeds) + "; > 1: slower than when profiled); "
          f"'at x{speed:.3f}' predicts with the cost model scaled by it")
    print(f"{'metric':>24} {'predicted':>10} {'measured':>10} {'spread':>9} {'error':>8}"
          f"      {f'at x{speed:.3f}':>10} {'error':>8}")
    for r, n in zip(rows, rows_now, strict=True):
        if r["measured"] is None:
            print(f"{r['metric']:>24} {'-':>10} {'-':>10}")
            continue
        print(f"{r['metric']:>24} {r['predicted']:>10.4g} {r['measured']:>10.4g} "
              f"{r['spread']:>9.3g} {r['error']:>+8.1%}{'' if r['within'] else ' OUT':4} "
              f" {n['predicted']:>10.4g} {n['error']:>+8.1%}{'' if n['within'] else ' OUT'}")
    if a.out:
        Path(a.out).write_text(json.dumps({"load": workload.source, "model": a.model,
                                           "cost_model": cost.name, "predicted": predicted,
                                           "runs": runs, "contention": contentions,
                                           "steal": steals, "machine_speed": speeds,
                                           "compare": rows, "compare_at_speed": rows_now},
                                          indent=1) + "\n", encoding="utf-8")
    return 0
