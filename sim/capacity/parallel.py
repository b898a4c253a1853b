"""`sim capacity --jobs N`: a sweep's runs spread over a `concurrent.futures.Executor`.

Every run of a sweep (one seed at one point) is independent: its own workload, fresh
engines, a deterministic simulation. So a run is one task, `run_task(SeedTask)`: a
top-level function of plain, picklable data that returns the seed's summary (and, for the
first seed, the timeline and stats that the plots draw; the records stay in the worker).
`ParallelPlanner` is a `Planner` that submits a point's seeds as tasks, and `prefetch`
submits the whole grid at once. Results are read in submission order, never in completion
order, and fill the Planner's cache; `point()` and the SLO search then read the cache, so
a report is byte-identical to a serial run's. The SLO search is a sequence of rates, each
depending on the one before, so during a search only a rate's seeds run side by side.

`--jobs N` uses `process_pool(N)`: N spawned processes (spawn: a fresh interpreter, no
forked state). Any other `Executor` plugs into `plan_capacity(..., executor=...)`. Tasks
carry the tokenizer's name when one is given (each worker loads it once) and the
tokenizer itself otherwise (it pickles, about 1.5 MB); a cluster's workers need nanoserve
installed, and the model's tokenizer files too if they get a name. Dask:

    from distributed import Client
    client = Client("scheduler:8786")
    plan_capacity(..., executor=client.get_executor(), tokenizer_name=None)

`--executor ray` runs the tasks on Ray (`RayExecutor`): a cluster at `--ray-address`, or a
local instance of `--jobs` CPUs. An ObjectRef's `.future()` is a concurrent.futures.Future,
so collect() reads Ray's results as it reads a pool's: in submission order, and the report
is the same byte for byte. A cluster's nodes need nanoserve (and the tokenizer's model
files, since tasks name it) installed as on the driver.
"""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing
from collections.abc import Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from nanoserve.config import EngineConfig
from nanoserve.model.stub import StubModel
from nanoserve.tokenizer import Tokenizer
from sim.capacity.cost import CostModel
from sim.capacity.fleet import SimResult
from sim.capacity.plan import Plan, Planner, Progress, run_seed, stub_model
from sim.cli_util import tokenizer as load_tokenizer
from sim.load.workload import Workload

T = TypeVar("T")
Key = tuple[float | None, int, int]  # (rate, num_blocks, max_num_seqs)
Outcome = tuple[dict[str, Any], SimResult | None]


@dataclass(frozen=True, slots=True)
class SeedTask:
    """One seed at one point, as plain data: what a worker needs and nothing else."""

    workload: Workload  # at its own rate; the worker applies `rate`
    rate: float | None
    num_blocks: int
    config: EngineConfig  # the plan's, with this point's num_blocks and max_num_seqs
    cost: CostModel
    plan: Plan
    tokenizer: str | Tokenizer  # a name to load once per worker, or the tokenizer itself
    timeline: bool  # send back the timeline and stats (the first seed's, for the plots)


def run_task(task: SeedTask) -> Outcome:
    """A worker's whole job: the seed's summary, and its result without the records (the
    per-request lists are most of its size and nothing after the summary reads them)."""
    outputs = task.workload.recorded_outputs() if task.plan.recorded else None
    tok, model = _model(task.tokenizer, task.config, task.plan.copy_prob, outputs)
    summary, result = run_seed(task.workload, task.rate, task.num_blocks, task.config,
                               task.cost, task.plan, model, tok)
    return summary, dataclasses.replace(result, records=()) if task.timeline else None


def _model(source: str | Tokenizer, config: EngineConfig, copy_prob: float,
           outputs: dict[tuple[int, ...], tuple[int, ...]] | None
           ) -> tuple[Tokenizer, StubModel]:
    tok = source if isinstance(source, Tokenizer) else _named_tokenizer(source)
    if isinstance(source, Tokenizer) or outputs:  # a recording's stub is its own
        return tok, stub_model(tok, config, copy_prob, outputs)
    return tok, _stub(tok, config.max_model_len, copy_prob)


@functools.lru_cache(maxsize=4)
def _named_tokenizer(name: str) -> Tokenizer:
    return load_tokenizer(name)  # once per worker process: spawned workers start empty


@functools.lru_cache(maxsize=4)
def _stub(tok: Tokenizer, max_model_len: int | None, copy_prob: float) -> StubModel:
    return stub_model(tok, EngineConfig(max_model_len=max_model_len), copy_prob)


class RayExecutor(Executor):
    """Tasks as Ray remote functions of one CPU each. Connects to `address` (a running
    cluster: "auto", "ray://head:10001", "10.0.0.1:6379") or starts a local instance of
    `num_cpus` CPUs, and shuts down only an instance it started."""

    def __init__(self, address: str | None = None, num_cpus: int | None = None) -> None:
        import ray  # only `--executor ray` needs it

        self._ray = ray
        self._owned = not ray.is_initialized()
        if self._owned:
            local: dict[str, Any] = {} if address else {
                "num_cpus": num_cpus,
                # The object store holds only tasks and summaries (kilobytes): no need for
                # the default of 30% of the machine's memory.
                "object_store_memory": 128 << 20}
            ray.init(address=address, include_dashboard=False, log_to_driver=False,
                     configure_logging=False, **local)
        self._remote: dict[Any, Any] = {}

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        if fn not in self._remote:
            self._remote[fn] = self._ray.remote(num_cpus=1)(fn)
        future: Future[Any] = self._remote[fn].remote(*args, **kwargs).future()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if self._owned and self._ray.is_initialized():
            self._ray.shutdown()
            self._owned = False


def make_executor(kind: str, jobs: int, ray_address: str | None = None) -> Executor | None:
    """`--executor KIND --jobs N`: None (in process) for one local job, else a pool of N
    spawned processes, or Ray (a local instance of N CPUs unless `ray_address`)."""
    if kind == "ray":
        return RayExecutor(ray_address, jobs)
    if kind != "process":
        raise ValueError(f"--executor must be process or ray, got {kind!r}")
    if ray_address is not None:
        raise ValueError("--ray-address needs --executor ray")
    return process_pool(jobs) if jobs > 1 else None


def process_pool(jobs: int) -> ProcessPoolExecutor:
    """`--jobs N`: N fresh (spawned) processes."""
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    return ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"))


def collect(futures: Sequence[Future[T]], progress: Progress | None = None,
            label: str = "runs") -> list[T]:
    """The futures' results in submission order. A failed run raises here, and the runs
    not yet started are cancelled."""
    out: list[T] = []
    try:
        for f in futures:
            out.append(f.result())
            if progress is not None:
                progress(label, len(out), len(futures))
    finally:
        for f in futures:
            f.cancel()  # a no-op on finished and running ones
    return out


class ParallelPlanner(Planner):
    """A Planner whose runs are tasks on `executor`. It does not own the executor: the
    caller shuts it down. `run()`'s first-seed result has no records (see `run_task`)."""

    def __init__(self, workloads: Sequence[Workload], cost: CostModel, plan: Plan,
                 tokenizer: Tokenizer, executor: Executor, *,
                 tokenizer_name: str | None = None, progress: Progress | None = None) -> None:
        super().__init__(workloads, cost, plan, tokenizer, progress)
        self.executor = executor
        self._source: str | Tokenizer = tokenizer_name or tokenizer

    def prefetch(self, keys: Sequence[Key]) -> None:
        """Runs every seed of every point not yet cached, all submitted at once."""
        missing = [k for k in dict.fromkeys(keys) if not self.cached(*k)]
        for key, (summaries, first) in zip(missing, self._runs(missing), strict=True):
            self.remember(*key, summaries, first)

    def run_seeds(self, rate: float | None, num_blocks: int, max_num_seqs: int
                  ) -> tuple[list[dict[str, Any]], SimResult]:
        return self._runs([(rate, num_blocks, max_num_seqs)])[0]

    def _runs(self, keys: Sequence[Key]) -> list[tuple[list[dict[str, Any]], SimResult]]:
        n = len(self.workloads)
        tasks = [self._task(key, k) for key in keys for k in range(n)]
        futures = [self.executor.submit(run_task, t) for t in tasks]
        rate, blocks, seqs = keys[0]
        label = (f"{len(keys)} points x {n} seeds" if len(keys) > 1 else
                 f"rate={'own' if rate is None else f'{rate:.4g}'} blocks={blocks} "
                 f"seqs={seqs}, {n} seeds")
        outcomes = collect(futures, self.progress, label)
        out = []
        for i in range(len(keys)):
            seeds = outcomes[i * n:(i + 1) * n]
            first = seeds[0][1]
            assert first is not None  # seed 0's task asks for its timeline
            out.append(([summary for summary, _ in seeds], first))
        return out

    def _task(self, key: Key, seed: int) -> SeedTask:
        rate, num_blocks, max_num_seqs = key
        return SeedTask(self.workloads[seed], rate, num_blocks,
                        self.engine_config(num_blocks, max_num_seqs), self.cost, self.plan,
                        self._source, timeline=seed == 0)
