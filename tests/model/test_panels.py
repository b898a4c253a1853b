"""Panels (model/panels.py, model/unpack.py, csrc/panels.cpp): every block format's weights
taken apart and laid out 16 output rows side by side hold exactly gguf-py's values; the
multiply equals a float32 matmul over them up to the order of additions at every row count
and remainder of the kernel's row blocks, in each instruction set's build; and a projection
runs on them at the row counts of PANEL_ROWS, the LM head and the layers of a real model too."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.native_check import ISA_PARAMS, kernels_for
from test_quant_formats import random_weight, reference

from nanoserve.model import native
from nanoserve.model.panels import PANEL, PANEL_ROWS, Panels
from nanoserve.model.quant import QuantProj, QuantWeight

pytestmark = pytest.mark.skipif(not native.available(), reason="needs the native kernels")

PANEL_FORMATS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")


def panels(w: QuantWeight) -> Panels | None:
    return Panels.of(w.format, w.blocks, w.cols)


def values(p: Panels) -> torch.Tensor:
    """The weights the panels hold, [rows, cols]: s * q + o, as gguf-py rounds it."""
    w = p.q.float() * p.scales.repeat_interleave(16, dim=1)  # [panels, cols, 16]
    if p.offsets is not None:
        w = w + p.offsets.repeat_interleave(16, dim=1)
    return w.permute(0, 2, 1).reshape(-1, p.q.shape[1])


@pytest.mark.parametrize("fmt", PANEL_FORMATS)
def test_the_panels_hold_the_blocks_values_exactly(fmt: str) -> None:
    for w in (random_weight(fmt, 2 * PANEL, 512, seed=1, extreme=True),
              random_weight(fmt, PANEL, 256, seed=2)):
        p = panels(w)
        assert p is not None
        assert p.q.shape == (w.rows // PANEL, w.cols, PANEL)
        assert p.scales.shape == (w.rows // PANEL, w.cols // 16, PANEL)
        assert (p.offsets is None) == (fmt in ("q8_0", "q4_0", "q5_0", "q6_k"))
        assert torch.equal(values(p), reference(w))


def test_only_whole_panels_of_a_quantized_format_have_them() -> None:
    assert panels(random_weight("q8_0", PANEL + 8, 64, seed=0)) is None
    assert panels(random_weight("f16", PANEL, 64, seed=0)) is None


@pytest.mark.parametrize("isa", ISA_PARAMS)
@pytest.mark.parametrize("fmt", ["q8_0", "q4_1", "q6_k"])  # plain, offset, groups of 16
# Each row-block remainder of both builds (16 rows a pass on AVX-512, 12 on AVX2) and more
# than one pass.
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 11, 12, 13, 16, 17, 25, 40])
def test_the_panel_multiply_is_a_matmul_over_the_same_values(fmt: str, rows: int,
                                                             isa: str) -> None:
    k = kernels_for(isa)
    w = random_weight(fmt, 4 * PANEL, 256, seed=rows)
    p = panels(w)
    assert p is not None
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 300, generator=g)[:, 20:276]  # a view: rows 300 apart
    out = torch.full((rows, 5 * PANEL), 7.0)
    got = p(k.ops, x, out[:, 8: 8 + 4 * PANEL])  # into a view of a wider output
    ref = reference(w).double()
    want, scale = x.double() @ ref.t(), x.double().abs() @ ref.abs().t()
    # float32 rounding of 256 additions in some order: far below 1e-5 of the terms' sum
    assert ((got.double() - want).abs() <= 1e-5 * scale + 1e-30).all()
    assert (out[:, :8] == 7.0).all()
    assert (out[:, 8 + 4 * PANEL:] == 7.0).all()
    # a row's outputs are the same whichever rows share its call
    assert torch.equal(p(k.ops, x[rows - 1:].contiguous())[0], got[rows - 1])


@pytest.mark.parametrize("isa", [i for i in ISA_PARAMS if i.values[0] in PANEL_ROWS])
def test_a_projection_runs_on_its_panels_at_their_row_counts(
        isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    k = kernels_for(isa)
    # a fused weight whose parts differ in format: each part's panels into its columns
    parts = [random_weight("q5_0", 2 * PANEL, 256, seed=5), random_weight("q8_0", PANEL, 256,
                                                                          seed=6)]
    proj = QuantProj(QuantWeight.cat(parts), kernels=k).with_panels()
    assert len(proj.panels) == 2
    rows = PANEL_ROWS[isa]
    assert proj.panel_rows == rows
    calls: list[int] = []
    original = Panels.__call__

    def counted(self: Panels, ops: Any, x: torch.Tensor, out: Any = None) -> torch.Tensor:
        calls.append(x.shape[0])
        return original(self, ops, x, out)

    monkeypatch.setattr(Panels, "__call__", counted)
    ref = torch.cat([reference(p) for p in parts]).double()
    probes = [1, rows.start - 1, rows.start, 200] + ([rows.stop - 1, rows.stop]
                                                      if rows.stop <= 200 else [])
    for m in probes:
        x = torch.randn(m, 256)
        assert ((proj(x).double() - x.double() @ ref.t()).abs() < 1e-3).all()
    assert calls == [m for m in probes if m in rows for _ in range(2)]  # both pieces
    # a piece without panels (F16) keeps the whole projection on its kernels
    mixed = QuantProj(QuantWeight.cat([parts[1], random_weight("f16", PANEL, 256, seed=7)]),
                      kernels=k).with_panels()
    assert mixed.panels == ()


def test_the_embedded_model_runs_on_panels(smollm2_quantized: Any) -> None:
    m = smollm2_quantized
    projs = [m.lm_head, *(p for ly in m.layers for p in (ly.qkv, ly.o, ly.gate_up, ly.down))]
    on = m.lm_head.kernels.isa in PANEL_ROWS
    assert all(isinstance(p, QuantProj) and bool(p.panels) == on for p in projs)
