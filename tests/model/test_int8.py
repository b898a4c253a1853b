"""--int8-activations (model/int8.py): the int8 path is taken from INT8_FROM_ROWS rows and
no sooner, its products stay close to the exact ones, smoothing is what keeps an outlier
channel from taking the other channels' bits, and the prefill takes it only where PyTorch's
int8 GEMM is the faster."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.tiny_llama import write_tiny_llama

from nanoserve.model import int8, load
from nanoserve.model.int8 import INT8_FROM_ROWS, Int8Weight, int8_projections, quantize_rows
from nanoserve.model.linear import Proj


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def test_rows_are_rounded_to_8_bits_with_their_own_scale() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5], [254.0, 0.0, -127.0]])
    q, s = quantize_rows(x.clone())
    assert q.dtype == torch.int8
    assert s.flatten().tolist() == pytest.approx([2 / 127, 2.0])
    assert q.tolist() == [[64, -127, 32], [127, 0, -64]]


def test_the_int8_path_starts_at_int8_from_rows_and_stays_close() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g)
    proj = Proj(w, pack=False)
    x = torch.randn(INT8_FROM_ROWS, 64, generator=g)
    proj.int8 = Int8Weight(w, x.abs().amax(dim=0))
    below = proj(x[:-1])
    assert torch.equal(below, x[:-1] @ w.t())  # one row fewer: the exact path, bit for bit
    at = proj(x)
    assert not torch.equal(at, x @ w.t())
    assert _rel_err(at, x @ w.t()) < 0.02


def test_smoothing_keeps_an_outlier_channel_from_taking_the_others_bits() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 64, generator=g)
    x = torch.randn(INT8_FROM_ROWS, 64, generator=g)
    x[:, 3] *= 200.0  # one channel 200x the rest, as after a Llama's norms
    want = x @ w.t()
    smoothed = Int8Weight(w, x.abs().amax(dim=0))(x)
    flat = Int8Weight(w, torch.ones(64))  # no activation range: no smoothing to speak of
    assert _rel_err(smoothed, want) < 0.02
    assert _rel_err(flat(x), want) > 2 * _rel_err(smoothed, want)


def test_int8_activations_refuse_what_they_cannot_run_on() -> None:
    with pytest.raises(ValueError, match="int8_activations"):
        load("stub", int8_activations=True)


@pytest.mark.parametrize("pays", [True, False])
def test_the_prefill_takes_int8_only_where_the_int8_gemm_is_faster(
    pays: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, smollm2_folder: Path,
) -> None:
    """Where torch._int_mm is PyTorch's plain loop (a Zen 3: 45x slower than sgemm), an
    int8 prefill would be that much slower: the projections keep their exact path."""
    monkeypatch.setattr(int8, "int8_gemm_pays", lambda: pays)
    model, _ = load(str(write_tiny_llama(tmp_path / "tiny", smollm2_folder)),
                    int8_activations=True)
    projections = int8_projections(model.layers)  # type: ignore[attr-defined]  # a LlamaModel
    assert [p.int8 is not None for p in projections] == [pays] * 6


def test_the_int8_gemm_is_measured_against_the_float32_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slow = torch._int_mm

    def slower(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        for _ in range(40):
            out = slow(a, b)
        return out

    monkeypatch.setattr(int8.torch, "_int_mm", slower)
    assert not int8.int8_gemm_pays()
    monkeypatch.setattr(int8.torch, "_int_mm", lambda a, b: torch.empty(0))
    assert int8.int8_gemm_pays()
