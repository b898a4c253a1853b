"""The routers (sim.capacity.routers): SGLang's cache-aware policy placing hand-built arrivals
exactly, its prefix trees, and what it does to a fleet's prefix hit rate."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from support.tenants import tenants

from nanoserve.config import EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.model.stub import StubModel
from nanoserve.sampling.params import SamplingParams
from nanoserve.tokenizer import Tokenizer
from sim.capacity.cost import CostModel
from sim.capacity.fleet import simulate
from sim.capacity.plan import Plan, Planner
from sim.capacity.routers import CacheAwareConfig, PrefixTree, Router
from sim.commands import main
from sim.load.workload import SimRequest

COST = CostModel((0.01, 1e-4, 5e-4, 2e-3, 2e-6, 1e-8, 0.0, 0.0, 0.0, 0.0), name="synthetic-test",
                 model="stub", machine={"cpu": "test"}, kv_bytes_per_token=46080)
ENGINE = EngineConfig(num_blocks=512, max_model_len=2048, max_num_seqs=16,
                      max_num_batched_tokens=256)


def seq(start: int, n: int) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def test_prefix_tree_matches_splits_and_counts_tokens() -> None:
    t = PrefixTree()
    t.insert((1, 2, 3, 4), 1)
    t.insert((1, 2, 9), 2)  # splits the edge after (1, 2)
    assert t.size == 5  # 1 2 3 4 + 9
    assert [t.match(p) for p in [(1, 2, 3, 4, 5), (1, 2, 9), (1, 2, 7), (5,), ()]] == \
        [4, 3, 2, 0, 0]
    t.insert((1, 2, 3, 4), 3)  # nothing new
    assert t.size == 5


def test_prefix_tree_evicts_least_recently_used_leaves_first() -> None:
    t = PrefixTree()
    t.insert((1, 2, 3, 4), 1)
    t.insert((1, 2, 7, 8), 2)
    t.insert((5, 6), 3)
    t.insert((1, 2, 3, 4), 4)  # refreshes the 3 4 branch: 7 8 is now the oldest leaf
    t.evict(6)
    assert t.size == 6
    assert (t.match((1, 2, 7, 8)), t.match((1, 2, 3, 4)), t.match((5, 6))) == (2, 4, 2)
    t.evict(2)  # then 5 6 (tick 3), then 3 4 (tick 4); the bare 1 2 stays
    assert (t.size, t.match((1, 2, 3, 4)), t.match((5, 6))) == (2, 2, 0)


def test_cache_aware_places_by_prefix_then_by_smallest_tree() -> None:
    r = Router("cache_aware", 3, 16)
    idle = [0, 0, 0]
    p = seq(1000, 40)  # a system prompt
    a = r.pick(p + seq(5000, 10), idle, 0.0)  # nothing cached: the smallest tree, index 0
    b = r.pick(seq(6000, 30), idle, 0.1)  # no match: smallest tree is 1 (0 holds 50)
    c = r.pick(p + seq(7000, 20), idle, 0.2)  # 40/60 > 0.5 matched on 0
    d = r.pick(seq(8000, 10), idle, 0.3)  # no match: replica 2's tree is empty
    e = r.pick(seq(6000, 15) + seq(9000, 15), idle, 0.4)  # 15/30 = 0.5 is not > 0.5:
    # the smallest tree, 2 (10 tokens) rather than 1 (30), which matched
    f = r.pick(seq(6000, 16) + seq(9500, 14), idle, 0.5)  # 16/30 > 0.5: to 1
    assert [a, b, c, d, e, f] == [0, 1, 0, 2, 2, 1]
    assert [t.size for t in r.trees] == [70, 44, 40]


def test_cache_aware_goes_to_the_least_loaded_only_past_both_thresholds() -> None:
    p = seq(1000, 64)
    r = Router("cache_aware", 3, 16)
    assert r.pick(p, [0, 0, 0], 0.0) == 0
    # 33 - 0 > 32 and 33 > 0 * 1.0001: imbalanced, to the least loaded (ties: lowest index)
    assert r.pick(p, [33, 2, 0], 0.1) == 2
    # 32 apart is not past the absolute threshold: the prefix decides (tie at 64: index 0)
    assert r.pick(p, [32, 2, 0], 0.2) == 0
    # Past the absolute threshold but not the relative one (rel 1.5: 104 <= 70 * 1.5)
    rel = Router("cache_aware", 2, 16, CacheAwareConfig(balance_rel_threshold=1.5))
    rel.pick(p, [0, 0], 0.0)
    assert rel.pick(p, [104, 70], 0.1) == 0
    assert rel.pick(p, [106, 70], 0.2) == 1
    # The imbalanced path inserts too: replica 2 now holds the prompt and matches it.
    assert r.trees[2].match(p) == 64


def test_cache_aware_eviction_runs_on_the_arrival_clock() -> None:
    cfg = CacheAwareConfig(eviction_interval_s=10.0, max_tree_size=8)
    r = Router("cache_aware", 2, 16, cfg)
    p = seq(1000, 20)
    assert r.pick(p, [0, 0], 0.0) == 0
    assert r.pick(p, [0, 0], 9.9) == 0  # no eviction yet: still matched
    assert r.pick(seq(3000, 4), [0, 0], 9.95) == 1
    # At t >= 10 the tree of 20 tokens is evicted to fit 8 (its one leaf goes whole); 1's 4
    # tokens stay. The prompt now matches nothing: the smallest tree (0, emptied) takes it.
    assert r.pick(seq(2000, 6), [0, 0], 10.0) == 0
    assert [t.size for t in r.trees] == [6, 4]
    assert r.trees[0].match(p) == 0


def test_simulated_fleet_places_a_burst_by_prefix_until_imbalanced(tok: Tokenizer) -> None:
    # 40 requests at t=0 that share a 64-token prefix: all are routed before any step runs,
    # so each sees the loads of those routed before it.
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=4)
    prefix = seq(1000, 64)
    reqs = [SimRequest(f"r{i}", 0.0, prefix + seq(20000 + 16 * i, 16), params)
            for i in range(40)]
    res = simulate(reqs, lambda: Engine(StubModel(tok), tok, ENGINE), COST, replicas=3,
                   router="cache_aware")
    placed = [r.replica for r in res.records]
    # 0..32 follow the prefix to replica 0 (the first: the smallest tree). At 33 in flight
    # on 0 and none elsewhere (33 > 32) the least loaded take over: r33 to 1, r34 to 2.
    # Then 33 - 1 is not > 32: balanced, and the longest match is on all three, so index 0
    # (r35); the next two see 34 - 1 and 34 - 1 (34, 2, 1) and go to the least loaded, the
    # one after sees 34 - 2 and follows the prefix again, and so on.
    assert placed == [0] * 33 + [1, 2, 0, 1, 2, 0, 1]
    assert all(r.status == "ok" for r in res.records)




def test_cache_aware_raises_the_prefix_hit_rate(tok: Tokenizer) -> None:
    engine = dataclasses.replace(ENGINE, num_blocks=48, max_model_len=768)

    def hit_rate(router: str) -> float:
        plan = Plan(engine, replicas=4, router=router, warmup=0.0)
        (summary,), _ = Planner([tenants(5)], COST, plan, tok).run(None, 48, 16)
        assert summary["status"]["ok"] == 240
        return float(summary["prefix_hit_rate"])

    rr, aware, affinity = (hit_rate(k) for k in ("round_robin", "cache_aware",
                                                 "prefix_affinity"))
    assert aware > rr + 0.2, (rr, aware)  # measured: 0.47 -> 0.79 (affinity 0.77)
    assert aware >= affinity - 0.02, (aware, affinity)


def test_capacity_cli_runs_a_cache_aware_fleet(tok: Tokenizer, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    cost = tmp_path / "cost.json"
    COST.save(cost)
    # Half the requests open with one 96-token prompt. Round robin pays its first miss on
    # each of the four replicas; cache_aware sends it where it is cached.
    spec = ("n=160,rate=8,prompt=uniform:8:32,output=uniform:4:16,shared_prefix=0.5:96,"
            "seed=2")

    def hit_rate(kind: str) -> float:
        out = tmp_path / kind
        code = main(["capacity", "--load", spec, "--cost", str(cost), "--replicas", "4",
                     "--router", kind, "--seeds", "1", "--engine", "num_blocks=40",
                     "max_model_len=512", "--out", str(out), "--no-plots", "--quiet"])
        assert code == 0
        rep = json.loads(Path(f"{out}.json").read_text())
        assert (rep["replicas"], rep["router"]) == (4, kind)
        assert rep["points"][0]["mean"]["finished"] > 0
        return float(rep["points"][0]["mean"]["prefix_hit_rate"])

    aware, rr = hit_rate("cache_aware"), hit_rate("round_robin")
    assert "cost model: synthetic-test" in capsys.readouterr().out
    assert aware >= rr, (aware, rr)  # measured: 0.71 against 0.70
