"""`sim capacity` end to end on the stub with a synthetic cost model: metrics recomputed from
the records, the SLO search's answer, byte-identical reports, fleets of replicas."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from support.tenants import tenants

from nanoserve.config import EngineConfig
from nanoserve.tokenizer import Tokenizer
from sim.capacity.capacity_commands import plan_capacity
from sim.capacity.cost import CostModel
from sim.capacity.plan import Plan, Planner
from sim.capacity.report import dumps_report
from sim.capacity.summary import measured, parse_slo
from sim.commands import main
from sim.load.spec import parse_load_spec
from sim.load.workload import Workload, spec_workload
from sim.stats import percentile_or_none

ROOT = Path(__file__).resolve().parents[3]

COST = CostModel((0.01, 1e-4, 5e-4, 2e-3, 2e-6, 1e-8, 0.0, 0.0, 0.0, 0.0), name="synthetic-test",
                 model="stub", machine={"cpu": "test"}, kv_bytes_per_token=46080)
ENGINE = EngineConfig(num_blocks=512, max_model_len=2048, max_num_seqs=16,
                      max_num_batched_tokens=256)
SLO = parse_slo("ttft_p99=1s,tpot_p99=100ms")
SPEC = "n=160,prompt=uniform:16:128,output=uniform:8:48"


def workloads(tok: Tokenizer, spec: str = SPEC, seeds: int = 1) -> list[Workload]:
    base = parse_load_spec(spec)
    return [spec_workload(parse_load_spec(f"{spec},seed={base.seed + k}"), tok)
            for k in range(seeds)]


def test_percentiles_equal_those_of_the_records(tok: Tokenizer) -> None:
    plan = Plan(ENGINE, warmup=0.1, slo=SLO)
    planner = Planner(workloads(tok), COST, plan, tok)
    (summary,), result = planner.run(6.0, 512, 16)
    recs = [r for r in result.records[16:] if r.status == "ok"]  # 10% of 160 is warm-up
    assert len(recs) == 144
    assert summary["measured"] == 144
    ttft = [r.first_token_s - r.arrival_s for r in recs]  # type: ignore[operator]
    tpot = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) for r in recs]
    itl = [b - a for r in recs for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    e2e = [r.finish_s - r.arrival_s for r in recs]  # type: ignore[operator]
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        for q in (50, 90, 99):
            assert summary["latency"][name][f"p{q}"] == pytest.approx(
                float(np.percentile(values, q)), rel=1e-12), (name, q)
    window = max(r.finish_s for r in result.records[16:]) - result.records[16].arrival_s  # type: ignore[type-var]
    assert summary["output_token_throughput"] == pytest.approx(
        sum(r.output_tokens for r in recs) / window)
    assert summary["request_throughput"] == pytest.approx(144 / window)
    good = sum(t <= 1 and p <= 0.1 for t, p in zip(ttft, tpot, strict=True))
    assert summary["goodput"] == pytest.approx(good / window)


def test_percentile_and_warmup_helpers() -> None:
    assert percentile_or_none([], 50) is None
    assert percentile_or_none([3.0], 99) == 3.0
    assert percentile_or_none([4.0, 1.0, 2.0, 3.0], 50) == 2.5
    assert percentile_or_none([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)
    with pytest.raises(ValueError, match="warmup"):
        measured([], 1.0)
    with pytest.raises(ValueError, match="ttft_p99=2s"):
        parse_slo("ttft=2")
    assert str(parse_slo("ttft_p99=2s,tpot_p90=200ms")) == "ttft_p99=2000ms,tpot_p90=200ms"


def test_slo_search_returns_a_rate_that_meets_it_while_ten_percent_more_fails(
    tok: Tokenizer,
) -> None:
    plan = Plan(ENGINE, warmup=0.1, slo=SLO)
    planner = Planner(workloads(tok, seeds=2), COST, plan, tok)
    found = planner.search(512, 16, start=2.0)
    rate = found["max_rate"]
    assert rate is not None
    assert found["fails_at"] <= rate * 1.02 + 1e-9
    assert planner.meets(rate, 512, 16)
    assert not planner.meets(rate * 1.1, 512, 16)
    # Every rate tried is one arrival pattern compressed: p99 TTFT grows with rate.
    tried = sorted(t["rate"] for t in found["tried"])
    p99 = [max(s["latency"]["ttft"]["p99"] for s in planner.run(r, 512, 16)[0]) for r in tried]
    assert p99 == sorted(p99)


def test_same_inputs_give_byte_identical_json(tok: Tokenizer) -> None:
    def report() -> str:
        plan = Plan(ENGINE, slo=SLO, max_queue=12)
        rep = plan_capacity(workloads(tok, seeds=2), [0, 1], COST, plan, tok,
                            {"rate": [4.0, 12.0], "max_num_seqs": [8.0]}, 4.0)
        return dumps_report(rep)

    first, second = report(), report()
    assert first == second
    rep = json.loads(first)
    assert rep["cost_model"]["name"] == "synthetic-test"
    assert rep["points"][1]["mean"]["rejected_429"] > 0  # 12/s overflows a queue of 12
    assert rep["points"][0]["kv_gib"] == pytest.approx(512 * 16 * 46080 / 2**30)
    assert len(rep["points"][0]["seeds"]) == 2


def _max_rate(tok: Tokenizer, replicas: int, router: str, spec: str) -> float:
    plan = Plan(ENGINE, replicas=replicas, router=router, warmup=0.1, slo=SLO, tol=0.01)
    found = Planner(workloads(tok, spec), COST, plan, tok).search(512, 16, start=4.0)
    assert found["max_rate"] is not None
    return float(found["max_rate"])


def test_two_round_robin_replicas_sustain_about_twice_the_rate(tok: Tokenizer) -> None:
    spec = "n=400,prompt=uniform:16:128,output=uniform:8:48"
    one = _max_rate(tok, 1, "round_robin", spec)
    two = _max_rate(tok, 2, "round_robin", spec)
    assert 1.7 <= two / one <= 2.3, (one, two)


def test_prefix_affinity_raises_the_prefix_hit_rate(tok: Tokenizer) -> None:
    # Eight tenants, each with its own 128-token system prompt (8 blocks). A replica's pool
    # of 48 blocks cannot keep all eight prompts cached beside the running requests, but it
    # can keep the two that prefix affinity sends it.
    load = tenants(5)
    engine = dataclasses.replace(ENGINE, num_blocks=48, max_model_len=768)

    def hit_rate(router: str) -> float:
        plan = Plan(engine, replicas=4, router=router, warmup=0.0)
        (summary,), _ = Planner([load], COST, plan, tok).run(None, 48, 16)
        assert summary["status"]["ok"] == 240
        return float(summary["prefix_hit_rate"])

    rr, affinity = hit_rate("round_robin"), hit_rate("prefix_affinity")
    assert affinity > rr + 0.2, (rr, affinity)  # measured: 0.47 -> 0.77


def test_cli_writes_json_csv_and_plots(tok: Tokenizer, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    cost = tmp_path / "cost.json"
    COST.save(cost)
    out = tmp_path / "cap"
    code = main(["capacity", "--load", "n=60,prompt=uniform:16:64,output=uniform:4:16",
                 "--cost", str(cost), "--sweep", "rate=2,8", "--slo", "ttft_p99=1s",
                 "--seeds", "2", "--engine", "num_blocks=256", "max_model_len=1024",
                 "--out", str(out), "--quiet"])
    assert code == 0
    text = capsys.readouterr().out
    assert "cost model: synthetic-test" in text
    assert "highest rate" in text
    rep = json.loads(Path(f"{out}.json").read_text())
    assert [p["rate"] for p in rep["points"]] == [2.0, 8.0]
    assert rep["slo_search"][0]["max_rate"] > 0
    csv_lines = Path(f"{out}.csv").read_text().splitlines()
    assert len(csv_lines) == 1 + 2 * 3  # header; per point a mean row and two seeds
    for suffix in ("latency.png", "timeline.png"):
        assert Path(f"{out}.{suffix}").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["capacity", "--cost", str(cost)]) == 2  # neither a trace nor --load
    assert "give a TRACE or --load" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_each_embedded_models_committed_cost_model_plans(
        name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """sim/costs/ holds a cost model per embedded model, measured by `sim profile`; each
    loads, says whose it is, and plans a small load with that model's tokenizer and KV
    size (Gemma's pool is sized from its own bytes per token)."""
    path = ROOT / "sim" / "costs" / f"{name}-cpu.json"
    d = json.loads(path.read_text())
    assert d["model"] == name
    assert d["fit"]["held_out_mean_rel_error"] < 0.05
    code = main(["capacity", "--load", "n=20,prompt=uniform:16:64,output=uniform:4:16",
                 "--cost", str(path), "--tokenizer", name, "--sweep", "rate=2",
                 "--out", str(tmp_path / "cap"), "--quiet"])
    assert code == 0
    assert f"cost model: {name}-cpu.json ({name} on" in capsys.readouterr().out
