"""The measured side of `sim validate`: real engines behind the bridge, driven by clients.

A fleet is N AsyncEngines in one Trio run, each with its own engine and model object (the
model holds its replica's KV cache, so replicas cannot share one). One dispatcher task takes
the arrivals in order: at each one's at_s it asks the router (sim/capacity/routers.py, the
same object the simulated fleet uses) for a replica, given every bridge's requests in flight,
and queues the request there at once, so the next arrival sees it counted, as the simulator's
does. A reader task per request streams its updates and notes when each arrives.

`drive_fleet` works under any clock: under the virtual clock (trio.testing.MockClock) it is
the slow, Trio path that tests/sim/capacity/test_capacity_fleet.py holds the fast engine-level loop
(sim/capacity/fleet.py) to. Under the live clock each bridge runs its steps in a worker
thread (LiveClock), so N replicas step in parallel, as far as the torch threads (validate's
--threads) and the GIL held by each step's Python let them.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import trio

from nanoserve.bridge import AsyncEngine, RequestStream
from nanoserve.bridge.clock import LiveClock, Step
from nanoserve.config import EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.engine.outputs import StepResult
from nanoserve.model.base import Model
from nanoserve.progress import bar
from nanoserve.sampling.params import ParamError, SamplingParams
from nanoserve.tokenizer import Tokenizer
from sim.capacity.acceptance import acceptance
from sim.capacity.calibrate import machine_speed, steal_seconds
from sim.capacity.cost import CostModel
from sim.capacity.fleet import Record, SimResult
from sim.capacity.plan import flat
from sim.capacity.routers import Router
from sim.capacity.summary import summarize
from sim.load.workload import SimRequest, Workload


async def drive_fleet(requests: Sequence[SimRequest], bridges: Sequence[AsyncEngine],
                      router: Router, max_queue: int | None = None,
                      on_done: Callable[[], object] | None = None,
                      outputs: dict[str, list[int]] | None = None) -> list[Record]:
    """Every request as a client of the fleet `bridges`, placed by `router`, from now;
    records in trio's clock, from now. `on_done` is called as each client ends; `outputs`,
    where given, gets each request's tokens by its id."""
    t0 = trio.current_time()
    records = [Record(r.id, r.at_s, len(r.prompt_ids)) for r in requests]

    def done() -> None:
        if on_done is not None:
            on_done()

    async with trio.open_nursery() as nursery:
        for req, rec in zip(requests, records, strict=True):
            await trio.sleep_until(t0 + req.at_s)
            loads = [b.statistics().in_flight for b in bridges]
            rec.replica = router.pick(req.prompt_ids, loads, req.at_s)
            stream = _submit(bridges[rec.replica], req, rec, max_queue)
            if stream is None:
                done()
            else:
                said = None if outputs is None else outputs.setdefault(req.id, [])
                nursery.start_soon(_read, stream, req, rec, t0, done, said)
    return records


async def drive_bridge(requests: Sequence[SimRequest], bridge: AsyncEngine,
                       max_queue: int | None = None,
                       on_done: Callable[[], object] | None = None) -> list[Record]:
    """`drive_fleet` on one bridge."""
    return await drive_fleet(requests, [bridge], Router("round_robin", 1, 1), max_queue,
                             on_done)


def _submit(bridge: AsyncEngine, req: SimRequest, rec: Record, max_queue: int | None
            ) -> RequestStream | None:
    """Queue `req` on `bridge` now, or settle its record as the server would refuse it."""
    if max_queue is not None:
        s = bridge.statistics()
        if s.queued + s.waiting + 1 > max_queue:
            rec.status = "rejected"
            return None
    try:
        prepared = bridge.prepare(list(req.prompt_ids), req.params)
    except ParamError:
        rec.status = "invalid"
        return None
    if req.stream and req.hangup_after_frames == 0:
        rec.status = "aborted"
        return None
    return bridge.stream(prepared, request_id=req.id)


async def _read(stream: RequestStream, req: SimRequest, rec: Record, t0: float,
                done: Callable[[], None], said: list[int] | None) -> None:
    try:
        async with stream:
            async for u in stream:
                now = trio.current_time() - t0
                rec.observe(u, now)
                if said is not None:
                    said.extend(u.new_token_ids)
                if u.finished:
                    return
                if req.stream and req.hangup_after_frames is not None \
                        and rec.frames >= req.hangup_after_frames:
                    rec.status = "aborted"  # leaving `async with` aborts it at the boundary
                    rec.finish_s = now
                    return
    finally:
        done()


class TimedLiveClock(LiveClock):
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


def measure(workload: Workload, engines: Sequence[Engine], router: Router,
            progress: str | None = None,
            outputs: dict[str, list[int]] | None = None) -> tuple[SimResult, float]:
    """One wall-clock run of the workload on a fleet of `engines` (real weights, one model
    object each) via the live clock, and the steps' contention: their wall time over their
    threads' CPU time, all replicas together (1 on idle cores with one torch thread; more
    when other processes, or the replicas' own Python under the GIL, share the cores).
    `progress`: a bar with that label over the requests, on a terminal; `outputs`, where
    given, gets each request's tokens by its id."""
    clocks = [TimedLiveClock() for _ in engines]

    async def main() -> list[Record]:
        async with AsyncExitStack() as stack:
            bridges = [await stack.enter_async_context(AsyncEngine.open(e, c))
                       for e, c in zip(engines, clocks, strict=True)]
            # One throwaway request each first: the first steps pay for lazy initialisation.
            async with trio.open_nursery() as nursery:
                for b in bridges:
                    warm = b.prepare([1000] * 8, SamplingParams(temperature=0, max_tokens=2))
                    nursery.start_soon(b.generate, warm)
            return await drive_fleet(workload.requests, bridges, router,
                                     on_done=lambda: shown.update(1), outputs=outputs)

    shown = bar(len(workload.requests), progress or "", enabled=progress is not None,
                unit="request")
    try:
        records = trio.run(main)
    finally:
        shown.close()
    end = max((r.finish_s or 0.0 for r in records), default=0.0)
    wall, cpu = sum(c.wall for c in clocks), sum(c.cpu for c in clocks)
    contention = wall / cpu if cpu else 1.0
    stats = tuple(e.statistics() for e in engines)
    return SimResult(tuple(records), (), stats, end), contention


# Steps that took this much longer than their CPU time, or a host that stole this fraction
# of a CPU, mark a run as measured on a busy host: its figures are flagged.
DISTURBED_WAIT = 1.10
DISTURBED_STEAL = 0.10


def agreement(predicted: SimResult, measured: SimResult) -> float:
    """The fraction of requests the measured fleet placed where the simulated one did."""
    same = sum(p.replica == m.replica
               for p, m in zip(predicted.records, measured.records, strict=True))
    return same / len(predicted.records) if predicted.records else 1.0


@dataclass(slots=True)
class Measured:
    """The measured runs' figures, one entry per run in each list; `speeds` has one more, the
    machine's speed taken before the first run."""

    runs: list[dict[str, Any]] = field(default_factory=list)  # each run's flat summary
    contention: list[float] = field(default_factory=list)
    steal: list[float | None] = field(default_factory=list)
    placed: list[float] = field(default_factory=list)
    speeds: list[float] = field(default_factory=list)
    acceptance: list[float | None] = field(default_factory=list)  # speculation's, each run
    results: list[SimResult] = field(default_factory=list)
    outputs: dict[str, list[int]] = field(default_factory=dict)  # the first run's tokens


def measure_runs(workload: Workload, models: Sequence[Model], tok: Tokenizer, cost: CostModel,
                 config: EngineConfig, sim: SimResult | None, *, runs: int, router: str,
                 warmup: float, quiet: bool) -> Measured:
    """`runs` wall-clock runs of `workload` on fresh engines over `models` (one a replica,
    placed by `router`), each told on stderr as it ends (and flagged if the host was busy);
    `sim` is the simulated run whose placements each run is held against (None: not yet
    run; the caller holds them)."""
    replicas = len(models)
    m = Measured()
    # The machine's speed against the cost model's before each run and after the last
    # (sim/capacity/calibrate.py): what tells the host's drift apart from the model's error.
    m.speeds.append(machine_speed(models[0], tok, cost))
    for k in range(runs):
        steal0, t0 = steal_seconds(), time.perf_counter()
        label = None if quiet else f"sim validate: run {k + 1}/{runs}"
        engines = [Engine(model, tok, config) for model in models]
        placer = Router(router, replicas, config.block_size)
        result, contention = measure(workload, engines, placer, label,
                                     m.outputs if k == 0 else None)
        steal1, wall = steal_seconds(), time.perf_counter() - t0
        m.steal.append(None if steal0 is None or steal1 is None else (steal1 - steal0) / wall)
        m.contention.append(contention)
        if sim is not None:
            m.placed.append(agreement(sim, result))
        m.results.append(result)
        m.acceptance.append(acceptance(result))
        m.speeds.append(machine_speed(models[0], tok, cost))
        m.runs.append(flat(summarize(result, warmup=warmup, slo=None,
                                     num_blocks=config.num_blocks or 1, replicas=replicas)))
        print(f"run {k + 1}/{runs}: {m.runs[-1]['output_token_throughput']:.1f} tok/s, "
              f"ttft p50 {m.runs[-1]['ttft_p50']}, tpot p50 {m.runs[-1]['tpot_p50']}, "
              f"steps took {contention:.2f}x their CPU time, machine speed "
              f"x{m.speeds[-2]:.3f} before, x{m.speeds[-1]:.3f} after"
              + (f", {m.placed[-1]:.0%} placed as simulated"
                 if replicas > 1 and sim is not None else ""),
              file=sys.stderr, flush=True)
        if contention > DISTURBED_WAIT or (m.steal[-1] or 0.0) > DISTURBED_STEAL:
            print(f"run {k + 1}: disturbed: the steps waited {contention - 1:.0%} beyond their "
                  f"CPU time, the host stole {m.steal[-1] or 0.0:.0%} of a CPU; its wall-clock "
                  "figures say as much about the host as about the model", file=sys.stderr,
                  flush=True)
    return m
