"""The engine-level virtual clock: nanoserve's own engines, stepped in modelled time.

Capacity planning needs millions of steps, so it drives `Engine.step()` directly rather
than through the Trio bridge and HTTP. The rules are the bridge's (nanoserve.bridge) under
the virtual clock (nanoserve.bridge.clock.VirtualClock), restated as a discrete-event loop:

- A replica takes a step boundary at its own time `now`. At the boundary it first applies
  the aborts of clients that hung up during the last step, then admits every arrival routed
  to it so far (all have at_s <= now), then runs one step, which lasts `cost(result)`
  seconds; the step's updates are delivered at its end, which is the next boundary.
- An idle replica's next boundary is the arrival that wakes it.
- Events are taken in time order; an arrival at exactly a boundary's time joins it.
- 429s: the server refuses a request when the waiting ones (arrivals not yet taken at a
  boundary, plus the scheduler's queue) would exceed `max_queue` (server/jobs.py).
- A streaming client that hangs up after k frames is aborted at the boundary after the
  step that sent its k-th frame; a frame is an update with text or a finish (docs/ARCHITECTURE.md).

With one replica this is the same sequence of steps as AsyncEngine + VirtualClock
(tests/sim/capacity/test_capacity_fleet.py checks it), and with N it plans a fleet: a router
places each arrival on a replica when it arrives, seeing every replica's load (requests
routed to it and not finished) at that moment. The routers are sim/capacity/routers.py,
shared with the measured fleet of `sim validate`. One difference from a real fleet: a step's
updates are computed at its start, so a request that finishes in a step stops counting
towards its replica's load from the step's start here, from its end in a fleet of bridges.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from nanoserve.engine.admission import Prepared
from nanoserve.engine.engine import Engine
from nanoserve.engine.outputs import EngineStats, StepResult
from nanoserve.engine.request import Update
from nanoserve.sampling.params import ParamError
from sim.capacity.routers import ROUTERS as ROUTERS
from sim.capacity.routers import CacheAwareConfig, Router
from sim.load.workload import SimRequest


@dataclass(slots=True)
class Record:
    """One request's life, in virtual seconds."""

    id: str
    arrival_s: float
    prompt_tokens: int
    replica: int = -1
    status: str = "pending"  # ok | rejected (429) | aborted (hang-up) | failed | invalid
    output_tokens: int = 0
    cached_tokens: int = 0
    frames: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    token_times: list[float] = field(default_factory=list)  # each token's: its step's end

    def observe(self, u: Update, t: float) -> None:
        """Account one update that reached the client at `t`: tokens, frames (one per update
        with text or a finish, as the server sends them) and, when final, the outcome."""
        if u.new_token_ids:
            if self.first_token_s is None:
                self.first_token_s = t
                self.cached_tokens = u.num_cached_tokens
            n = len(u.new_token_ids)
            self.output_tokens += n
            # A time per token: a checked proposal's kept tokens arrive in one update, and
            # TPOT and ITL count tokens (summary.py), as `sim bench` does. One is the usual
            # case, once per simulated token: an append, not a list made to extend with.
            if n == 1:
                self.token_times.append(t)
            else:
                self.token_times.extend([t] * n)
        if u.text or u.finished:
            self.frames += 1
        if u.finished:
            self.status = "failed" if u.error is not None or u.finish_reason == "error" else "ok"
            self.finish_s = t


@dataclass(frozen=True, slots=True)
class Sample:
    """A replica's state over one step: [t, t + dt)."""

    t: float
    dt: float
    replica: int
    queue: int  # routed, not yet running: arrivals before the boundary + scheduler waiting
    running: int
    used_blocks: int


@dataclass(frozen=True, slots=True)
class SimResult:
    records: tuple[Record, ...]
    timeline: tuple[Sample, ...]
    stats: tuple[EngineStats, ...]  # per replica, at the end
    end_s: float


@dataclass(slots=True, eq=False)
class _Replica:
    index: int
    engine: Engine
    now: float = 0.0
    pending: deque[tuple[Prepared, Record]] = field(default_factory=deque)
    hangups: list[str] = field(default_factory=list)

    def active(self) -> bool:
        return bool(self.pending or self.engine.has_unfinished())

    def load(self) -> int:
        s = self.engine.scheduler
        return len(self.pending) + len(s.waiting) + len(s.running)


def simulate(
    requests: Sequence[SimRequest],
    make_engine: Callable[[], Engine],
    cost: Callable[[StepResult], float],
    *,
    replicas: int = 1,
    router: str = "round_robin",
    max_queue: int | None = None,
    on_progress: Callable[[int], None] | None = None,
    cache_aware: CacheAwareConfig | None = None,
) -> SimResult:
    """Run `requests` (in arrival order) on `replicas` fresh engines in modelled time.
    `router` (sim/capacity/routers.py) places each arrival seeing every replica's load."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    reps = [_Replica(i, make_engine()) for i in range(replicas)]
    policy = Router(router, replicas, reps[0].engine.config.block_size, cache_aware)

    def pick(req: SimRequest) -> _Replica:
        return reps[policy.pick(req.prompt_ids, [r.load() for r in reps], req.at_s)]

    records = [Record(r.id, r.at_s, len(r.prompt_ids)) for r in requests]
    by_id: dict[str, tuple[SimRequest, Record]] = {}
    timeline: list[Sample] = []
    i, n = 0, len(requests)
    while True:
        t_arrival = requests[i].at_s if i < n else math.inf
        busy = [r for r in reps if r.active()]
        rep = min(busy, key=lambda r: (r.now, r.index)) if busy else None
        if rep is None and i >= n:
            break
        if rep is None or t_arrival <= rep.now:
            _arrive(requests[i], records[i], pick(requests[i]), max_queue, by_id)
            i += 1
            if on_progress is not None:
                on_progress(i)
            continue
        _boundary(rep, by_id, cost, timeline)
    end = max((r.now for r in reps), default=0.0)
    stats = tuple(r.engine.statistics() for r in reps)
    return SimResult(tuple(records), tuple(timeline), stats, end)


def _arrive(req: SimRequest, rec: Record, rep: _Replica, max_queue: int | None,
            by_id: dict[str, tuple[SimRequest, Record]]) -> None:
    rec.replica = rep.index
    if not rep.active():
        rep.now = max(rep.now, req.at_s)  # an idle replica wakes at the arrival
    if max_queue is not None and len(rep.pending) + rep.engine.statistics().waiting + 1 \
            > max_queue:
        rec.status = "rejected"
        return
    try:
        prepared = rep.engine.prepare(list(req.prompt_ids), req.params)
    except ParamError:
        rec.status = "invalid"  # the server's 400 before the first byte
        return
    if req.stream and req.hangup_after_frames == 0:
        rec.status = "aborted"  # gone before the boundary that would admit it
        return
    by_id[req.id] = (req, rec)
    rep.pending.append((prepared, rec))


def _boundary(rep: _Replica, by_id: dict[str, tuple[SimRequest, Record]],
              cost: Callable[[StepResult], float], timeline: list[Sample]) -> None:
    eng = rep.engine
    for rid in rep.hangups:  # in the order their frames went out: canonical
        eng.abort_request(rid)
        by_id[rid][1].status = "aborted"
        by_id[rid][1].finish_s = rep.now
        del by_id[rid]
    rep.hangups.clear()
    while rep.pending:
        prepared, rec = rep.pending.popleft()
        eng.admit(prepared, rec.id)
    if not eng.has_unfinished():
        return
    # The queues and the pool read directly: Engine.statistics() builds a whole
    # EngineStats, twice a step, millions of steps in a sweep.
    sched, pool = eng.scheduler, eng.pool
    waiting, running = len(sched.waiting), len(sched.running)
    result = eng.step()
    dt = cost(result)
    if not (math.isfinite(dt) and dt >= 0):
        raise ValueError(f"step cost must be finite seconds >= 0, got {dt!r}")
    t0 = rep.now
    rep.now = t = t0 + dt
    timeline.append(Sample(t0, dt, rep.index, waiting, running,
                           pool.num_blocks - pool.num_free))
    for u in result.updates:
        entry = by_id.get(u.request_id)
        if entry is None:
            continue
        req, rec = entry
        rec.observe(u, t)
        if u.finished:
            del by_id[u.request_id]
        elif req.stream and req.hangup_after_frames is not None \
                and rec.frames >= req.hangup_after_frames:
            rep.hangups.append(u.request_id)
