"""`sim profile` and the cost model: the grid it measures, the fit, the JSON it writes.
Timings here are synthetic (an injected timer or a known linear law), never measured."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from nanoserve.engine.outputs import StepResult
from nanoserve.model.stub import StubModel
from nanoserve.tokenizer import Tokenizer
from sim.capacity.cost import FEATURES, CostModel, fit_coefficients, load_cost_model, step_features
from sim.capacity.profile import QUICK_GRID, fit_profile, measure_grid
from sim.commands import main

LAW = (0.02, 1.5e-4, 3e-3, 2.5e-3, 4e-6, 2e-8, 6e-3, 4e-4, 0.0, 0.0)  # a known "machine"


def counting_timer() -> object:
    t = [0.0]

    def timer() -> float:
        t[0] += 0.5
        return t[0]

    return timer


def test_grid_covers_every_point_with_the_work_it_names(tok: Tokenizer) -> None:
    points = measure_grid(StubModel(tok), tok, QUICK_GRID, reps=3,
                          timer=counting_timer())  # type: ignore[arg-type]
    # decode 0 is measured at one context only, and never with prefill 0.
    want = [(0, 16, 8), (0, 16, 24), (0, 16, 40)] + [
        (d, c, p) for d in (1, 6) for c in (16, 48) for p in (0, 8, 24, 40)]
    assert [(p.decode, p.context, p.prefill) for p in points] == want
    for p in points:
        f = dict(zip(FEATURES, p.features, strict=True))
        assert p.seconds == 0.5
        assert f["decode_seqs"] == p.decode
        assert f["prefill_tokens"] == p.prefill
        assert f["prefill_seqs"] == (1 if p.prefill else 0)
        # The decode rows sit a few tokens past their prompt of `context` tokens.
        assert p.decode * (p.context + 1) <= f["decode_context"] <= p.decode * (p.context + 20)
        if p.prefill:
            assert f["prefill_attention"] == p.prefill * (p.prefill + 1) // 2
        # One row through the weights is a gemv; only decode 1 with no prompt has one.
        assert f["batched"] == (0 if (p.decode, p.prefill) == (1, 0) else 1)


def test_reps_are_interleaved_over_the_whole_grid(tok: Tokenizer) -> None:
    # A host that slows down steadily: the k-th timed step lasts k seconds. Were a cell's
    # reps taken back to back, the first cell would keep the fast times and the last the
    # slow ones; interleaved, every point's median is its middle rep, from one sweep.
    calls = [0]

    def drifting() -> float:
        calls[0] += 1
        k = (calls[0] + 1) // 2  # the k-th timed step's start and end reads
        return float(k * (k + 1) // 2) if calls[0] % 2 == 0 else float(k * (k - 1) // 2)

    points = measure_grid(StubModel(tok), tok, QUICK_GRID, reps=3,
                          timer=drifting)
    n = len(points)
    assert sorted(p.seconds for p in points) == [float(k) for k in range(n + 1, 2 * n + 1)]


def test_fit_recovers_a_linear_law_and_holds_out_a_quarter(tok: Tokenizer) -> None:
    points = measure_grid(StubModel(tok), tok, QUICK_GRID, reps=1,
                          timer=counting_timer())  # type: ignore[arg-type]
    law = CostModel(LAW)
    exact = [dataclasses.replace(p, seconds=law.predict(p.features)) for p in points]
    cost = fit_profile(exact, name="law", model="stub", machine={"cpu": "x"},
                       kv_bytes_per_token=0, block_size=16, grid=QUICK_GRID)
    assert cost.coef == pytest.approx(LAW, rel=1e-6)
    assert (len(points), cost.fit["held_out"]) == (19, 4)
    assert cost.fit["held_out_max_rel_error"] < 1e-6


def test_fit_weights_relative_error() -> None:
    # Two regimes no line fits exactly: the fit balances relative, not absolute, error.
    xs = [(1.0, float(n), 0, 0, 0, 0, 0, 0, 0, 0) for n in (1, 2, 100, 200)]
    ys = [0.011, 0.012, 0.2, 0.5]
    coef = fit_coefficients(xs, ys, use=("const", "prefill_tokens"))
    m = CostModel(coef)
    errs = [abs(m.predict(x) - y) / y for x, y in zip(xs, ys, strict=True)]
    assert max(errs[:2]) < 0.35  # an absolute fit would miss the 11 ms steps by 4x
    assert coef[2:] == (0.0,) * 8


def test_cost_model_prices_a_step_and_round_trips(tmp_path: Path) -> None:
    m = CostModel(LAW, name="law", model="smollm2", machine={"cpu": "x"},
                  kv_bytes_per_token=46080)
    r = StepResult(1, (), (), 100, 8, 2, 800, 5050)
    # 108 rows: through the quantized tile kernel (more than 8, fewer than 128).
    assert step_features(r) == (1.0, 100.0, 2.0, 8.0, 800.0, 5050.0, 1.0, 108.0, 0.0, 0.0)
    assert m(r) == pytest.approx(0.02 + 0.015 + 0.006 + 0.02 + 0.0032 + 1.01e-4 + 0.006
                                 + 0.0432)
    one = StepResult(2, (), (), 0, 1, 0, 200, 0)  # a lone decode row: the gemv, no `batched`
    assert step_features(one) == (1.0, 0.0, 0.0, 1.0, 200.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    assert m(one) == pytest.approx(0.02 + 0.0025 + 0.0008)
    assert m.kv_gib(1024) == pytest.approx(1024 * 16 * 46080 / 2**30)
    path = tmp_path / "c.json"
    m.save(path)
    assert load_cost_model(path) == m
    d = json.loads(path.read_text())
    d["coef"].pop("decode_seqs")
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="exactly the keys"):
        load_cost_model(path)
    with pytest.raises(ValueError, match="not a nanoserve cost model"):
        CostModel.from_dict({"coef": {}})
    assert CostModel((-1.0,) + (0,) * 9).predict((1,) + (0,) * 9) == 0.0


def test_older_cost_models_load_without_the_newer_terms(tmp_path: Path) -> None:
    d = CostModel(LAW, name="law").to_dict()
    assert d["nanoserve_cost_model"] == 4
    d["nanoserve_cost_model"] = 3
    del d["coef"]["panel_blocks"], d["coef"]["prefill_cached_pairs"]
    assert CostModel.from_dict(d).coef == LAW[:8] + (0.0, 0.0)
    d["nanoserve_cost_model"] = 2
    del d["coef"]["tile_rows"]
    assert CostModel.from_dict(d).coef == LAW[:7] + (0.0,) * 3
    d["nanoserve_cost_model"] = 1
    del d["coef"]["batched"]
    assert CostModel.from_dict(d).coef == LAW[:6] + (0.0,) * 4
    d["coef"]["batched"] = 1.0  # format 1 never had it: a file that says 1 but has it is wrong
    with pytest.raises(ValueError, match="format 1 coef must have exactly the keys"):
        CostModel.from_dict(d)


@pytest.mark.parametrize(("prefill", "decode", "tile"), [
    (0, 1, 0), (0, 8, 0), (0, 9, 9), (32, 32, 64), (96, 31, 127), (96, 32, 0), (448, 0, 0)])
def test_tile_rows_are_the_rows_between_the_register_and_the_dense_paths(
        prefill: int, decode: int, tile: int) -> None:
    # The bands of nanoserve/model/quant.py: up to 8 rows in registers, from 128 the
    # dequantized sgemm; a step's rows in between cost more each (profiled: 3.8 ms a row
    # on one thread against 2.6-3.0 on either side, SmolLM2 Q4_1).
    r = StepResult(1, (), (), prefill, decode, 1 if prefill else 0, 0, 0)
    assert dict(zip(FEATURES, step_features(r), strict=True))["tile_rows"] == tile


def test_profile_cli_writes_the_machine_and_the_held_out_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "stub-cost.json"
    assert main(["profile", "--model", "stub", "--quick", "--reps", "1", "--out", str(out)]) == 0
    assert "held-out (4) relative error" in capsys.readouterr().out
    cost = load_cost_model(out)
    assert cost.name == "stub-cost.json"
    assert cost.model == "stub"
    assert {"cpu", "cores", "torch"} <= set(cost.machine)
    assert len(cost.fit["samples"]) == 19


def test_cpu_clock_needs_one_thread(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.get_num_threads() == 1:
        pytest.skip("this process already runs torch on one thread")
    assert main(["profile", "--model", "stub", "--quick", "--clock", "cpu"]) == 2
    assert "--clock cpu needs --threads 1" in capsys.readouterr().err


@pytest.mark.parametrize(("isa", "rows", "tile", "passes"), [
    ("avx512", 1, 0, 0), ("avx512", 4, 0, 0), ("avx512", 5, 0, 1), ("avx512", 16, 0, 1),
    ("avx512", 17, 0, 2), ("avx512", 33, 0, 3), ("avx512", 512, 0, 32),
    ("avx2", 7, 0, 0), ("avx2", 8, 0, 1), ("avx2", 12, 0, 1), ("avx2", 13, 13, 0),
    ("avx2", 127, 127, 0), ("avx2", 128, 0, 0),
    (None, 9, 9, 0), (None, 16, 16, 0), (None, 128, 0, 0)])
def test_panel_passes_follow_the_kernels_of_the_machines_isa(
        isa: str | None, rows: int, tile: int, passes: int) -> None:
    # model/quant.py's dispatch with panels (model/panels.py): on AVX-512 from 5 rows, one
    # pass over the weights per 16 rows; on AVX2 from 8 to 12 rows, one pass, the tile band
    # above; None is the dispatch before panels, which format 3 cost models were fitted to.
    r = StepResult(1, (), (), 0, rows, 0, 0, 0)
    f = dict(zip(FEATURES, step_features(r, isa), strict=True))
    assert (f["tile_rows"], f["panel_blocks"]) == (tile, passes)


def test_a_cost_model_prices_with_the_isa_it_was_profiled_on() -> None:
    law = (0.0,) * 8 + (0.01, 0.0)
    r = StepResult(1, (), (), 0, 17, 0, 0, 0)
    assert CostModel(law, machine={"isa": "avx512"})(r) == pytest.approx(0.02)  # 2 passes
    assert CostModel(law, machine={"isa": "avx2"})(r) == 0.0  # 17 rows: the tile band
    assert CostModel(law, machine={"cpu": "x"})(r) == 0.0  # format 3: no panels


def test_the_grid_times_the_last_chunk_of_long_prompts(tok: Tokenizer) -> None:
    # A chunked prefill's step: 512 prompt tokens after `off` already in the KV cache, so its
    # attention pairs are 512 x off plus the chunk's own triangle.
    grid = {**QUICK_GRID, "chunk_offsets": (1024,)}
    points = measure_grid(StubModel(tok, max_position_embeddings=4096), tok, grid, reps=1,
                          timer=counting_timer())  # type: ignore[arg-type]
    (last,) = [p for p in points if p.context == 1024]
    f = dict(zip(FEATURES, last.features, strict=True))
    assert (last.decode, last.prefill) == (0, 512)
    assert (f["prefill_tokens"], f["decode_seqs"]) == (512, 0)
    assert f["prefill_attention"] == 512 * 1024 + 512 * 513 // 2
    assert f["prefill_cached_pairs"] == 512 * 1024  # its keys before the step: cached
    assert len(points) == 20  # QUICK_GRID's 19 and this one
