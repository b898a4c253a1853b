"""`sim capacity`: sweeps and an SLO search over nanoserve's own engine in modelled time.

A point is (rate, num_blocks, max_num_seqs). Each point runs its workload once per seed (a
spec's seed changes arrivals, lengths and prompts; a trace has one), on fresh engines with
the stub model, stepped by `sim.capacity.fleet.simulate` with the step-cost model's durations; its
metrics are the mean over seeds with their min and max (the spread).

The SLO search finds, for each (num_blocks, max_num_seqs), the highest rate at which every
seed meets the SLO: it doubles (or halves) from a starting rate until it brackets the
boundary, then bisects geometrically until the bracket is within `tol` (2%). Because every
rate is one seeded arrival pattern compressed in time (sim.load.workload), latency grows
with rate, so the bracket holds a single crossing in practice.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nanoserve.config import EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.model.stub import STUB_CONTEXT, StubModel
from nanoserve.tokenizer import Tokenizer
from sim.capacity.cost import CostModel
from sim.capacity.fleet import SimResult, simulate
from sim.capacity.summary import Slo, summarize
from sim.load.workload import Workload

CAPACITY_FORMAT = 1
Progress = Callable[[str, int, int], None]  # (label, done, total)


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything but the swept values: what every point shares."""

    engine: EngineConfig
    replicas: int = 1
    router: str = "round_robin"
    max_queue: int | None = None
    warmup: float = 0.1
    slo: Slo | None = None
    tol: float = 0.02
    # Speculation's acceptance rate the plan was given (--acceptance), the stub's copy
    # probability found for it (acceptance.py) and the rate that gave in the fit.
    acceptance: float | None = None
    copy_prob: float = 0.0
    fit_acceptance: float | None = None
    # --acceptance recorded: the stub says each request's recorded tokens (a trace's).
    recorded: bool = False


def default_num_blocks(cost: CostModel, engine: EngineConfig) -> int:
    """The pool the real model would get from `kv_cache_memory` (the engine's own rule), or
    the stub's when the cost model does not know the KV size."""
    if engine.num_blocks is not None:
        return engine.num_blocks
    per_block = cost.kv_bytes_per_token * engine.block_size
    return engine.kv_cache_memory // per_block if per_block else engine.stub_num_blocks


def stub_model(tokenizer: Tokenizer, engine: EngineConfig, copy_prob: float = 0.0,
               outputs: Mapping[tuple[int, ...], Sequence[int]] | None = None) -> StubModel:
    """The stub the simulated engines share (it is stateless), with context enough for
    the plan's max_model_len: planning a long-context model on a long trace (Mooncake's
    prompts reach 120k tokens) needs `--engine max_model_len=131072`, and the engine
    refuses a max_model_len past its model's context."""
    return StubModel(tokenizer, copy_prob=copy_prob, outputs=outputs,
                     max_position_embeddings=max(STUB_CONTEXT, engine.max_model_len or 0))


def flat(summary: dict[str, Any]) -> dict[str, float | None]:
    """A summary's scalars under flat names (CSV columns, spread over seeds)."""
    out: dict[str, float | None] = {
        "request_throughput": summary["request_throughput"],
        "output_token_throughput": summary["output_token_throughput"],
        "goodput": summary["goodput"],
    }
    for metric, pcts in summary["latency"].items():
        for k, v in pcts.items():
            out[f"{metric}_{k}"] = v
    out.update(queue_mean=summary["queue"]["mean"], queue_max=summary["queue"]["max"],
               kv_mean_used_fraction=summary["kv"]["mean_used_fraction"],
               kv_peak_used_fraction=summary["kv"]["peak_used_fraction"],
               preemptions=summary["preemptions"], prefix_hit_rate=summary["prefix_hit_rate"],
               rejected_429=summary["status"]["rejected"], aborted=summary["status"]["aborted"],
               failed=summary["status"]["failed"] + summary["status"]["invalid"],
               finished=summary["status"]["ok"], measured=summary["measured"],
               steps=summary["steps"], window_s=summary["window_s"])
    return out


def run_seed(workload: Workload, rate: float | None, num_blocks: int, config: EngineConfig,
             cost: CostModel, plan: Plan, model: StubModel, tokenizer: Tokenizer, *,
             on_progress: Callable[[int], None] | None = None
             ) -> tuple[dict[str, Any], SimResult]:
    """One seed at one point, on fresh engines: its summary and raw result. The one body of
    a run, whether the Planner calls it in process or a worker of parallel.py does."""
    load = workload if rate is None else workload.at_rate(rate)

    def make() -> Engine:
        return Engine(model, tokenizer, config)

    result = simulate(load.requests, make, cost, replicas=plan.replicas, router=plan.router,
                      max_queue=plan.max_queue, on_progress=on_progress)
    return summarize(result, warmup=plan.warmup, slo=plan.slo, num_blocks=num_blocks,
                     replicas=plan.replicas), result


class Planner:
    def __init__(self, workloads: Sequence[Workload], cost: CostModel, plan: Plan,
                 tokenizer: Tokenizer, progress: Progress | None = None) -> None:
        if not workloads:
            raise ValueError("capacity planning needs at least one workload (seed)")
        self.workloads = list(workloads)
        self.cost = cost
        self.plan = plan
        self.model = stub_model(tokenizer, plan.engine, plan.copy_prob,
                                self.workloads[0].recorded_outputs() if plan.recorded else None)
        self.tokenizer = tokenizer
        self.progress = progress
        self._cache: dict[tuple[float | None, int, int], tuple[list[dict[str, Any]],
                                                               SimResult]] = {}

    def engine_config(self, num_blocks: int, max_num_seqs: int) -> EngineConfig:
        return dataclasses.replace(self.plan.engine, num_blocks=num_blocks,
                                   max_num_seqs=max_num_seqs)

    def run(self, rate: float | None, num_blocks: int, max_num_seqs: int
            ) -> tuple[list[dict[str, Any]], SimResult]:
        """Per-seed summaries at one point, and the first seed's raw result (for plots).
        `rate` None runs the workloads at their own rate."""
        key = (rate, num_blocks, max_num_seqs)
        if key not in self._cache:
            self._cache[key] = self.run_seeds(rate, num_blocks, max_num_seqs)
        return self._cache[key]

    def run_seeds(self, rate: float | None, num_blocks: int, max_num_seqs: int
                  ) -> tuple[list[dict[str, Any]], SimResult]:
        """`run` without the cache: every seed, one after another (parallel.py overrides
        this to spread them over an executor)."""
        config = self.engine_config(num_blocks, max_num_seqs)
        summaries: list[dict[str, Any]] = []
        first: SimResult | None = None
        for k, w in enumerate(self.workloads):
            label = (f"rate={_fmt(w.base_rate if rate is None else rate)} blocks={num_blocks} "
                     f"seqs={max_num_seqs} seed {k + 1}/{len(self.workloads)}")
            tick = _ticker(self.progress, label, len(w.requests))
            summary, result = run_seed(w, rate, num_blocks, config, self.cost, self.plan,
                                       self.model, self.tokenizer, on_progress=tick)
            summaries.append(summary)
            first = first or result
        assert first is not None
        return summaries, first

    def cached(self, rate: float | None, num_blocks: int, max_num_seqs: int) -> bool:
        return (rate, num_blocks, max_num_seqs) in self._cache

    def remember(self, rate: float | None, num_blocks: int, max_num_seqs: int,
                 summaries: list[dict[str, Any]], first: SimResult) -> None:
        """Cache a point run elsewhere (parallel.py's prefetch): `run` then returns it."""
        self._cache[(rate, num_blocks, max_num_seqs)] = (summaries, first)

    def point(self, rate: float | None, num_blocks: int, max_num_seqs: int) -> dict[str, Any]:
        summaries, _ = self.run(rate, num_blocks, max_num_seqs)
        rows = [flat(s) for s in summaries]
        return {
            "rate": rate if rate is not None else self.workloads[0].base_rate,
            "num_blocks": num_blocks,
            "kv_gib": self.cost.kv_gib(num_blocks, self.plan.engine.block_size),
            "max_num_seqs": max_num_seqs,
            "meets_slo": (all(self.plan.slo.met_by(s) for s in summaries)
                          if self.plan.slo is not None else None),
            "mean": _agg(rows, lambda v: sum(v) / len(v)),
            "min": _agg(rows, min),
            "max": _agg(rows, max),
            "seeds": rows,
        }

    def meets(self, rate: float, num_blocks: int, max_num_seqs: int) -> bool:
        assert self.plan.slo is not None
        summaries, _ = self.run(rate, num_blocks, max_num_seqs)
        return all(self.plan.slo.met_by(s) for s in summaries)

    def search(self, num_blocks: int, max_num_seqs: int, start: float) -> dict[str, Any]:
        """The highest rate meeting the SLO (module docstring), with every rate tried."""
        tried: list[tuple[float, bool]] = []

        def ok(r: float) -> bool:
            met = self.meets(r, num_blocks, max_num_seqs)
            tried.append((r, met))
            return met

        lo: float | None = None
        hi: float | None = None
        r = start
        for _ in range(40):  # 2**40 either way: far past any server
            if ok(r):
                lo = r
                if hi is not None:
                    break
                r *= 2
            else:
                hi = r
                if lo is not None:
                    break
                r /= 2
        if lo is not None and hi is not None:
            while hi / lo > 1 + self.plan.tol:
                mid = math.sqrt(lo * hi)
                if ok(mid):
                    lo = mid
                else:
                    hi = mid
        return {"num_blocks": num_blocks, "max_num_seqs": max_num_seqs,
                "kv_gib": self.cost.kv_gib(num_blocks, self.plan.engine.block_size),
                "max_rate": lo, "fails_at": hi,
                "tried": [{"rate": t, "meets_slo": m} for t, m in tried]}


def _agg(rows: Sequence[dict[str, float | None]],
         fn: Callable[[list[float]], float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key in rows[0]:
        vals = [v for row in rows if (v := row[key]) is not None]
        out[key] = fn(vals) if vals else None
    return out


def _ticker(progress: Progress | None, label: str, total: int) -> Callable[[int], None] | None:
    if progress is None:
        return None
    step = max(total // 50, 1)

    def tick(done: int) -> None:
        if done % step == 0 or done == total:
            progress(label, done, total)

    return tick


def _fmt(x: float) -> str:
    return f"{x:.4g}"
