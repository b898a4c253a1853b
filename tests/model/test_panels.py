"""The LM head's panels (model/panels.py, csrc/panels.cpp): the same values as the Q8_0
blocks, a multiply equal to a float32 matmul over them up to the order of additions at every
row count and remainder of the kernel's row blocks, in each instruction set's build; and the
head of a real Q8_0 model runs on them from PANEL_FROM_ROWS rows."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from support.native_check import ISA_PARAMS, kernels_for

from nanoserve.model import native
from nanoserve.model.panels import PANEL, PANEL_FROM_ROWS, Q8Panels
from nanoserve.model.quant import QuantProj, QuantWeight, quantize

pytestmark = pytest.mark.skipif(not native.available(), reason="needs the native kernels")


def weight(rows: int, cols: int, seed: int = 0) -> QuantWeight:
    g = torch.Generator().manual_seed(seed)
    w = quantize(torch.randn(rows, cols, generator=g) * torch.logspace(-4, 1, rows)[:, None],
                 "q8_0")
    w.blocks[0, 0:2] = torch.tensor([1, 0], dtype=torch.uint8)  # d = 2^-24, subnormal
    w.blocks[PANEL + 3, 34:36] = 0  # a zero scale, inside a panel
    return w


def panels(w: QuantWeight) -> Q8Panels | None:
    return Q8Panels.of(w.format, w.blocks, w.cols)


def reference(w: QuantWeight) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf_dequantize(w.blocks.numpy(), GGMLQuantizationType.Q8_0),
                                     dtype=np.float32))


def test_the_panels_hold_the_blocks_values_exactly() -> None:
    w = weight(3 * PANEL, 96)
    p = panels(w)
    assert p is not None
    assert p.q.shape == (3, 96, PANEL)
    assert p.scales.shape == (3, 3, PANEL)
    values = p.q.float() * p.scales.repeat_interleave(32, dim=1)  # [panels, cols, 16]
    assert torch.equal(values.permute(0, 2, 1).reshape(3 * PANEL, 96), reference(w))


def test_only_a_q8_0_weight_of_whole_panels_has_them() -> None:
    assert panels(weight(PANEL + 8, 64)) is None
    assert panels(quantize(torch.randn(PANEL, 64), "q4_0")) is None


@pytest.mark.parametrize("isa", ISA_PARAMS)
# Each row-block remainder of both builds (16 rows a pass on AVX-512, 12 on AVX2) and more
# than one pass.
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 11, 12, 13, 16, 17, 25, 40])
def test_the_panel_multiply_is_a_matmul_over_the_same_values(rows: int, isa: str) -> None:
    k = kernels_for(isa)
    w = weight(4 * PANEL, 160, seed=rows)
    p = panels(w)
    assert p is not None
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 200, generator=g)[:, 20:180]  # a view: rows 200 apart
    got = p(k.ops, x)
    want = x.double() @ reference(w).double().t()
    scale = x.double().abs() @ reference(w).double().abs().t()  # the terms' magnitude
    assert got.shape == (rows, 4 * PANEL)
    # float32 rounding of 160 additions in some order: far below 1e-5 of the terms' sum
    assert ((got.double() - want).abs() <= 1e-5 * scale + 1e-30).all()
    # a row's outputs are the same whichever rows share its call
    assert torch.equal(p(k.ops, x[rows - 1:].contiguous())[0], got[rows - 1])


@pytest.mark.parametrize("isa", [i for i in ISA_PARAMS if i.values[0] in PANEL_FROM_ROWS])
def test_a_q8_0_head_runs_on_its_panels_from_the_threshold(
        isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from nanoserve.model.placement import _head
    k = kernels_for(isa)
    head = _head(QuantProj(weight(2 * PANEL, 64), kernels=k), _where(k))
    assert isinstance(head, QuantProj)
    assert head.panels is not None
    assert head.panel_from == PANEL_FROM_ROWS[isa]
    calls: list[int] = []
    original = Q8Panels.__call__

    def counted(self: Q8Panels, ops: Any, x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return original(self, ops, x)

    monkeypatch.setattr(Q8Panels, "__call__", counted)
    for rows in (1, head.panel_from - 1, head.panel_from, 64, 200):
        head(torch.randn(rows, 64))
    assert calls == [head.panel_from, 64, 200]


def _where(k: Any) -> Any:
    from nanoserve.model.placement import Placement
    return Placement(device=torch.device("cpu"), dtype=torch.float32, kernels=k,
                     quantized=True, pack_weights=False)


def test_the_embedded_models_head_has_panels(smollm2_quantized: Any) -> None:
    head = smollm2_quantized.lm_head
    assert isinstance(head, QuantProj)
    assert head.weight.format == "q8_0"
    assert (head.panels is not None) == (head.kernels.isa in PANEL_FROM_ROWS)
