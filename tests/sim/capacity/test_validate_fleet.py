"""`sim validate --replicas N --router KIND`: a fleet of bridges placed by the simulator's own
router objects (sim.capacity.measured), against the simulated fleet."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio
import trio.testing

from nanoserve.bridge import AsyncEngine
from nanoserve.bridge.clock import VirtualClock
from nanoserve.config import EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.model.stub import StubModel
from nanoserve.tokenizer import Tokenizer
from sim.capacity.cost import CostModel
from sim.capacity.fleet import Record, simulate
from sim.capacity.measured import drive_fleet
from sim.capacity.routers import Router
from sim.commands import main
from sim.load.spec import parse_load_spec
from sim.load.workload import SimRequest, spec_workload

COST = CostModel((0.01, 1e-4, 5e-4, 2e-3, 2e-6, 1e-8, 0.0, 0.0, 0.0, 0.0), name="synthetic")
CONFIG = EngineConfig(num_blocks=64, max_model_len=512, max_num_seqs=8,
                      max_num_batched_tokens=128)


def _bridges(tok: Tokenizer, reqs: list[SimRequest], router: str, n: int) -> list[Record]:
    async def run() -> list[Record]:
        async with AsyncEngine.open(Engine(StubModel(tok), tok, CONFIG), VirtualClock(COST)
                                    ) as a, \
                AsyncEngine.open(Engine(StubModel(tok), tok, CONFIG), VirtualClock(COST)
                                 ) as b:
            bridges = [a, b][:n]
            return await drive_fleet(reqs, bridges, Router(router, n, CONFIG.block_size))

    return trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))


@pytest.mark.parametrize("router", ["round_robin", "cache_aware"])
def test_a_fleet_of_bridges_is_the_simulated_fleet(tok: Tokenizer, router: str) -> None:
    # A light load (the fleet stays balanced) whose prompts half share a prefix longer than
    # their own tokens (so a match passes cache_threshold 0.5): the cache-aware placements
    # depend on the trees alone, so both sides place alike, and then each replica runs the
    # same steps at the same virtual times.
    reqs = list(spec_workload(parse_load_spec(
        "n=24,rate=5,prompt=uniform:8:48,output=uniform:2:12,shared_prefix=0.5:64,"
        "stream=true,seed=7"), tok).requests)
    fast = simulate(reqs, lambda: Engine(StubModel(tok), tok, CONFIG), COST, replicas=2,
                    router=router)
    slow = _bridges(tok, reqs, router, 2)
    placed = [r.replica for r in fast.records]
    assert placed == [r.replica for r in slow]
    assert set(placed) == {0, 1}
    if router == "cache_aware":  # the shared prefix kept to one replica
        shared = {r.replica for q, r in zip(reqs, fast.records, strict=True)
                  if q.prompt_ids[:64] == reqs_prefix(reqs)}
        assert len(shared) == 1
    for a, b in zip(fast.records, slow, strict=True):
        assert (a.id, a.status, a.output_tokens, a.cached_tokens) == \
            (b.id, b.status, b.output_tokens, b.cached_tokens)
        assert a.token_times == pytest.approx(b.token_times, abs=1e-9)


def reqs_prefix(reqs: list[SimRequest]) -> tuple[int, ...]:
    keys = [r.prompt_ids[:64] for r in reqs]
    return max(set(keys), key=keys.count)


def test_arrivals_at_one_instant_are_placed_in_arrival_order(tok: Tokenizer) -> None:
    # Six at t=0: a dispatcher takes them in order (one client task each would wake in
    # whatever order Trio chose), so round robin alternates exactly as simulated.
    reqs = list(spec_workload(parse_load_spec(
        "n=6,arrival=constant,rate=1000000,prompt=fixed:8,output=fixed:2"), tok).requests)
    assert [r.replica for r in _bridges(tok, reqs, "round_robin", 2)] == [0, 1, 0, 1, 0, 1]


def test_validate_cli_measures_a_two_replica_fleet(tmp_path: Path, tok: Tokenizer,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    cost = tmp_path / "cost.json"
    COST.save(cost)
    out = tmp_path / "v.json"
    code = main(["validate", "--model", "stub", "--load", "n=6,rate=40,prompt=fixed:24,"
                 "output=fixed:5", "--cost", str(cost), "--runs", "2", "--threads", "1",
                 "--replicas", "2", "--router", "round_robin", "--engine", "num_blocks=128",
                 "max_model_len=1024", "--out", str(out), "--quiet", "--report",
                 str(tmp_path / "calibration.txt")])
    assert code == 0
    printed = capsys.readouterr().out
    report = (tmp_path / "calibration.txt").read_text()
    # The command line as given, so the report says how to rerun it.
    assert report.startswith("sim validate --load n=6,rate=40,prompt=fixed:24,output=fixed:5 "
                             "--threads 1 --replicas 2 --router round_robin "
                             "--engine num_blocks=128 --engine max_model_len=1024 --cost ")
    assert "output_token_throughput" in report
    assert "run 2: contention" in report
    assert "2 replicas, router round_robin" in printed
    assert "placed on the simulator's replica: 100% 100%" in printed
    rep = json.loads(out.read_text())
    assert (rep["replicas"], rep["router"]) == (2, "round_robin")
    assert rep["placement_agreement"] == [1.0, 1.0]
    assert [r["finished"] for r in rep["runs"]] == [6, 6]
    assert rep["predicted"]["finished"] == 6
    with pytest.raises(SystemExit):
        main(["validate", "--load", "n=2", "--cost", str(cost), "--router", "nearest"])
