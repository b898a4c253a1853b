"""`sim capacity --trace FILE` on each public format's sample: the same bytes for the same
inputs, the trace's description in the report, and on the Mooncake sample a planned prefix
hit rate that matches the rate the trace implies when the pool can hold it all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sim.capacity.cost import CostModel
from sim.commands import main

ROOT = Path(__file__).resolve().parents[3]
SAMPLES = ROOT / "traces" / "public"
COST = CostModel((0.01, 1e-4, 5e-4, 2e-3, 2e-6, 1e-8, 0.0, 0.0, 0.0, 0.0), name="synthetic-test",
                 model="stub", machine={"cpu": "test"}, kv_bytes_per_token=46080)
AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.0000000,20,5
2023-11-16 18:15:53.2500000,1200,31
"""


def _run(args: list[str], out: Path, capsys: pytest.CaptureFixture[str]) -> tuple[str, dict]:
    assert main(["capacity", *args, "--out", str(out / "cap"), "--quiet", "--no-plots"]) == 0
    text = capsys.readouterr().out.replace(str(out), "OUT")
    return text, {p.name: p.read_bytes() for p in sorted(out.iterdir())}


@pytest.mark.parametrize(("sample", "extra"), [
    ("mooncake_conversation.jsonl", ["--duration", "12", "--engine", "max_model_len=131072",
                                     "num_blocks=8192"]),
    ("alibaba_format.jsonl", ["--speedup", "4"]),
    ("burstgpt_format.csv", ["--start", "600", "--duration", "1800", "--speedup", "60"]),
    ("azure.csv", []),
])
def test_each_format_plans_the_same_bytes_twice(tmp_path: Path, sample: str, extra: list[str],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    cost = tmp_path / "cost.json"
    COST.save(cost)
    path = SAMPLES / sample
    if sample == "azure.csv":
        path = tmp_path / sample
        path.write_text(AZURE)
    runs = [_run(["--trace", str(path), "--cost", str(cost), *extra], tmp_path / f"run{k}",
                 capsys) for k in range(2)]
    assert runs[0] == runs[1]
    text, files = runs[0]
    report = json.loads(files["cap.json"])
    fmt = sample.split("_")[0].removesuffix(".csv")
    assert report["trace"]["format"] == fmt
    assert f"({fmt}, as published by" in text
    (point,) = report["points"]
    # Every request measured (all but the warm-up tenth) finished: none refused as too long.
    assert point["mean"]["failed"] == 0
    assert point["mean"]["finished"] == point["mean"]["measured"] > 0


def test_mooncake_planned_hit_rate_matches_the_trace(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """With a pool that never evicts (300k blocks: the sample's 4.3M prompt tokens are 92%
    distinct), the engine's prefix cache serves what the trace says is shared, to within
    the engine's 16-token granularity; prefix structure ignored, it serves nothing."""
    cost = tmp_path / "cost.json"
    COST.save(cost)
    args = ["--trace", str(SAMPLES / "mooncake_conversation.jsonl"), "--cost", str(cost),
            "--engine", "max_model_len=131072", "num_blocks=300000", "--warmup", "0"]
    _, files = _run(args, tmp_path / "faithful", capsys)
    report = json.loads(files["cap.json"])
    implied = report["trace"]["implied_prefix_hit_rate"]
    planned = report["points"][0]["mean"]["prefix_hit_rate"]
    assert implied == pytest.approx(0.081023, abs=1e-6)
    assert abs(planned - implied) < 0.001  # the issue asks for 2 points; it is within 0.1
    _, files = _run([*args, "--ignore-prefixes"], tmp_path / "ignored", capsys)
    ignored = json.loads(files["cap.json"])
    assert ignored["trace"]["prefix_structure"] is False
    assert ignored["points"][0]["mean"]["prefix_hit_rate"] == 0.0


def test_trace_flags_need_a_public_trace(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    cost = tmp_path / "cost.json"
    COST.save(cost)
    code = main(["capacity", "--trace", str(ROOT / "traces" / "virtual.jsonl"), "--cost",
                 str(cost), "--speedup", "2", "--quiet", "--no-plots"])
    assert code == 2
    assert "apply to public traces" in capsys.readouterr().err
