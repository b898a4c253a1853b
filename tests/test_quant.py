"""Quantized weights (model/quant.py, csrc/quant.cpp): the file's blocks dequantize to
exactly gguf-py's values, and the multiply equals a float32 matmul over those values up to
the order of additions, at every row count both kernels serve."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from nanoserve.model import native
from nanoserve.model.loader import embedded_gguf_path, read_gguf_weights, resolve_model
from nanoserve.model.quant import BLOCK_BYTES, QuantProj, QuantWeight, quantize

pytestmark = pytest.mark.skipif(not native.available(), reason="needs the native kernels")


def reference(w: QuantWeight) -> torch.Tensor:
    qtype = GGMLQuantizationType[w.format.upper()]
    return torch.from_numpy(np.array(gguf_dequantize(w.blocks.numpy(), qtype),
                                     dtype=np.float32))


@pytest.mark.parametrize("fmt", sorted(BLOCK_BYTES))
def test_dequantize_is_bit_exact_with_gguf_py(fmt: str) -> None:
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(37, 96, generator=g) * torch.logspace(-6, 2, 37)[:, None]
    w = quantize(dense, fmt)
    assert w.blocks.shape == (37, 96 // 32 * BLOCK_BYTES[fmt])
    # Halves at the edges: a subnormal scale, a zero one, a negative offset.
    w.blocks[0, 0:2] = torch.tensor([1, 0], dtype=torch.uint8)  # d = 2^-24, subnormal
    w.blocks[1, 0:2] = 0
    assert torch.equal(w.dequantize(), reference(w))
    ids = torch.tensor([5, 0, 36, 5])
    assert torch.equal(w.take_rows(ids), reference(w)[ids])


@pytest.mark.parametrize("fmt", sorted(BLOCK_BYTES))
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 16, 33])  # both kernels, remainders
def test_linear_is_a_matmul_over_the_same_values(fmt: str, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w = quantize(torch.randn(83, 160, generator=g), fmt)  # 83: not a multiple of 4
    x = torch.randn(rows, 160, generator=g)
    got = QuantProj(w)(x)
    want = x.double() @ reference(w).double().t()
    assert got.shape == (rows, 83)
    assert (got.double() - want).abs().max().item() < 1e-4
    strided = torch.randn(rows, 200, generator=g)[:, 20:180]  # a view: rows 200 apart
    assert torch.allclose(QuantProj(w)(strided), QuantProj(w)(strided.contiguous()))


def test_the_gguf_blocks_are_the_converted_weights() -> None:
    """Kept as blocks (Q/K rows reordered as the converter reorders them), every tensor
    dequantizes to exactly the float32 the converter wrote."""
    from safetensors.torch import load_file

    blocks = read_gguf_weights(embedded_gguf_path(), keep=frozenset(BLOCK_BYTES))
    dense = load_file(str(resolve_model("smollm2") / "model.safetensors"))
    assert set(blocks) == set(dense)
    kinds = set()
    for name, w in blocks.items():
        if isinstance(w, QuantWeight):
            kinds.add(w.format)
            assert torch.equal(w.dequantize(), dense[name]), name
        else:
            assert torch.equal(w, dense[name]), name
    assert kinds == {"q4_1", "q8_0"}
