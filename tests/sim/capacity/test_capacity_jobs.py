"""`sim capacity --jobs N` (sim/capacity/parallel.py): the same report as a serial run, byte
for byte, from spawned processes or any `concurrent.futures.Executor`, whatever order the
runs finish in."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any

import pytest

from nanoserve.config import EngineConfig
from nanoserve.tokenizer import Tokenizer
from sim.capacity.capacity_commands import plan_capacity
from sim.capacity.cost import CostModel
from sim.capacity.parallel import collect, run_task
from sim.capacity.plan import Plan
from sim.capacity.summary import parse_slo
from sim.commands import main
from sim.load.spec import parse_load_spec
from sim.load.workload import spec_workload

# test_capacity.py's synthetic cost model and engine: fast, and with a knee in range.
COST = CostModel((0.01, 1e-4, 5e-4, 2e-3, 2e-6, 1e-8, 0.0, 0.0, 0.0, 0.0), name="synthetic-test",
                 model="stub", machine={"cpu": "test"}, kv_bytes_per_token=46080)
ENGINE = EngineConfig(num_blocks=512, max_model_len=2048, max_num_seqs=16,
                      max_num_batched_tokens=256)
LOAD = "n=60,prompt=uniform:16:64,output=uniform:4:16"


def _cli(out_dir: Path, cost: Path, jobs: int) -> list[str]:
    return ["capacity", "--load", LOAD, "--cost", str(cost), "--sweep", "rate=2,5,9",
            "--slo", "ttft_p99=60ms", "--seeds", "2", "--engine", "num_blocks=256",
            "max_model_len=1024", "--out", str(out_dir / "cap"), "--quiet", "--no-plots",
            "--jobs", str(jobs)]


def test_jobs_2_writes_the_same_bytes_as_jobs_1(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    cost = tmp_path / "cost.json"
    COST.save(cost)
    texts, files = [], []
    for jobs in (1, 2):  # 2: two spawned processes, the tokenizer loaded by name in each
        out = tmp_path / f"jobs{jobs}"
        assert main(_cli(out, cost, jobs)) == 0
        texts.append(capsys.readouterr().out.replace(str(out), "OUT"))
        files.append({p.name: p.read_bytes() for p in sorted(out.iterdir())})
    serial, parallel = files
    assert sorted(serial) == ["cap.csv", "cap.json"]
    assert parallel == serial
    assert texts[1] == texts[0]
    assert "highest rate 21.18 req/s" in texts[0]  # the SLO search ran, through the pool


class SwappingExecutor(Executor):
    """Runs tasks in the caller's thread, so that in every pair the later one finishes
    first: the second of a pair runs when it is submitted, the first waits until some
    result is asked for (then all that wait run, the last submitted first). Code that took
    results as they finish (`as_completed`, done-callbacks) would get every pair backwards."""

    def __init__(self) -> None:
        self.fns: list[Callable[..., Any]] = []
        self.completed: list[int] = []  # submission indices, in the order they finished
        self._waiting: list[tuple[int, Future[Any], Callable[..., Any], tuple[Any, ...]]] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        assert not kwargs
        index = len(self.fns)
        self.fns.append(fn)
        future = _AskedFuture(self)
        self._waiting.append((index, future, fn, args))
        if index % 2 == 1:
            self._run(self._waiting.pop())
        return future

    def run_waiting(self) -> None:
        while self._waiting:
            self._run(self._waiting.pop())

    def _run(self, job: tuple[int, Future[Any], Callable[..., Any], tuple[Any, ...]]) -> None:
        index, future, fn, args = job
        future.set_result(fn(*args))
        self.completed.append(index)


class _AskedFuture(Future[Any]):
    def __init__(self, executor: SwappingExecutor) -> None:
        super().__init__()
        self.executor = executor

    def result(self, timeout: float | None = None) -> Any:
        self.executor.run_waiting()
        return super().result(timeout)


def test_a_custom_executor_runs_every_task_and_finishing_order_changes_nothing(
    tok: Tokenizer, tmp_path: Path,
) -> None:
    """Also the plots: a worker sends back the first seed's timeline without its records."""
    plots = importlib.util.find_spec("matplotlib") is not None
    loads = [spec_workload(parse_load_spec(f"{LOAD},seed={s}"), tok) for s in (0, 1)]

    def report(executor: Executor | None) -> dict[str, bytes]:
        out = tmp_path / ("serial" if executor is None else "swapped") / "cap"
        plan = Plan(ENGINE, slo=parse_slo("ttft_p99=60ms"), max_queue=12)
        plan_capacity(loads, [0, 1], COST, plan, tok,
                      {"rate": [4.0, 12.0], "max_num_seqs": [8.0, 16.0]}, None,
                      executor=executor, plots=plots, out=out)
        return {p.name: p.read_bytes() for p in sorted(out.parent.iterdir())}

    executor = SwappingExecutor()
    swapped, serial = report(executor), report(None)
    assert len(serial) == (4 if plots else 2)
    assert swapped == serial
    # The grid (4 points x 2 seeds) and then each rate the searches tried (2 seeds each),
    # all on this executor, all finishing pairwise backwards.
    # Each point once per seed: the searches reuse the grid's runs through the cache.
    rep = json.loads(serial["cap.json"])
    keys = {(p["rate"], p["max_num_seqs"]) for p in rep["points"]} | {
        (t["rate"], s["max_num_seqs"]) for s in rep["slo_search"] for t in s["tried"]}
    assert len(keys) > len(rep["points"]) == 4
    assert len(executor.fns) == 2 * len(keys)
    assert set(executor.fns) == {run_task}
    assert executor.completed[:8] == [1, 3, 5, 7, 6, 4, 2, 0]  # the grid


def test_a_failed_run_raises_and_cancels_the_runs_not_started() -> None:
    done: Future[int] = Future()
    done.set_result(1)
    failed: Future[int] = Future()
    failed.set_exception(ValueError("boom"))
    pending: Future[int] = Future()
    ticks: list[tuple[str, int, int]] = []
    with pytest.raises(ValueError, match="boom"):
        collect([done, failed, pending], lambda *t: ticks.append(t), "grid")
    assert pending.cancelled()
    assert ticks == [("grid", 1, 3)]


def test_jobs_must_be_positive(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cost = tmp_path / "cost.json"
    COST.save(cost)
    with pytest.raises(SystemExit) as exit_:  # argparse's range check, before any run
        main(_cli(tmp_path, cost, 0))
    assert exit_.value.code == 2
    assert capsys.readouterr().err == ("sim capacity: error: argument --jobs: must be an "
                                       "integer >= 1, got 0\n")
