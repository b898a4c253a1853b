"""--int8-activations (model/int8.py): the int8 path is taken from INT8_FROM_ROWS rows and
no sooner, its products stay close to the exact ones, and smoothing is what keeps an
outlier channel from taking the other channels' bits."""

from __future__ import annotations

import pytest
import torch

from nanoserve.model import load
from nanoserve.model.int8 import INT8_FROM_ROWS, Int8Weight, quantize_rows
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
