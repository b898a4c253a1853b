"""Quantized weights (model/quant.py, csrc/quant.cpp): the file's blocks dequantize to
exactly gguf-py's values, and the multiply equals a float32 matmul over those values up to
the order of additions, at every row count both kernels serve, in each instruction set's
build (avx512, avx2, generic; those this CPU lacks skip)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from support.native_check import ISA_PARAMS, kernels_for

from nanoserve.model import native
from nanoserve.model.gguf import read_gguf_weights
from nanoserve.model.loader import embedded_gguf_path, resolve_model
from nanoserve.model.quant import BLOCK_BYTES, QuantProj, QuantWeight, quantize

pytestmark = pytest.mark.skipif(not native.available(), reason="needs the native kernels")


# The formats gguf-py quantizes from floats, as these tests build their weights; the other
# kernel formats (the K-quants, F16, BF16, Q5_*) are tests/model/test_quant_formats.py's.
QUANTIZED = ("q4_0", "q4_1", "q8_0")


def reference(w: QuantWeight) -> torch.Tensor:
    qtype = GGMLQuantizationType[w.format.upper()]
    return torch.from_numpy(np.array(gguf_dequantize(w.blocks.numpy(), qtype),
                                     dtype=np.float32))


@pytest.mark.parametrize("isa", ISA_PARAMS)
@pytest.mark.parametrize("fmt", QUANTIZED)
def test_dequantize_is_bit_exact_with_gguf_py(fmt: str, isa: str) -> None:
    k = kernels_for(isa)
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(37, 96, generator=g) * torch.logspace(-6, 2, 37)[:, None]
    w = quantize(dense, fmt)
    assert w.blocks.shape == (37, 96 // 32 * BLOCK_BYTES[fmt])
    # Halves at the edges: a subnormal scale, a zero one, a negative offset.
    w.blocks[0, 0:2] = torch.tensor([1, 0], dtype=torch.uint8)  # d = 2^-24, subnormal
    w.blocks[1, 0:2] = 0
    assert torch.equal(w.dequantize(k), reference(w))
    ids = torch.tensor([5, 0, 36, 5])
    assert torch.equal(w.take_rows(ids, k), reference(w)[ids])


@pytest.mark.parametrize("isa", ISA_PARAMS)
@pytest.mark.parametrize("fmt", QUANTIZED)
# Every path (registers, tiles, dense) with every accumulator layout and remainder.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 33, 130])
def test_linear_is_a_matmul_over_the_same_values(fmt: str, rows: int, isa: str) -> None:
    k = kernels_for(isa)
    g = torch.Generator().manual_seed(rows)
    w = quantize(torch.randn(83, 160, generator=g), fmt)  # 83: not a multiple of 3 or 4
    x = torch.randn(rows, 160, generator=g)
    got = QuantProj(w, kernels=k)(x)
    want = x.double() @ reference(w).double().t()
    assert got.shape == (rows, 83)
    assert (got.double() - want).abs().max().item() < 1e-4
    strided = torch.randn(rows, 200, generator=g)[:, 20:180]  # a view: rows 200 apart
    proj = QuantProj(w, kernels=k)
    assert torch.allclose(proj(strided), proj(strided.contiguous()))


def test_the_gguf_blocks_are_the_converted_weights() -> None:
    """Kept as blocks (Q/K rows reordered as the converter reorders them), every tensor
    dequantizes to exactly the float32 the converter wrote."""
    from nanoserve.model.llama import load_weights

    blocks = read_gguf_weights(embedded_gguf_path(), keep=frozenset(BLOCK_BYTES))
    dense = load_weights(resolve_model("smollm2"))
    assert set(blocks) == set(dense)
    kinds = set()
    for name, w in blocks.items():
        if isinstance(w, QuantWeight):
            kinds.add(w.format)
            assert torch.equal(w.dequantize(), dense[name]), name
        else:
            assert torch.equal(w, dense[name]), name
    assert kinds == {"q4_1", "q8_0"}


@pytest.mark.real
def test_the_decode_stack_is_the_layer_loop_bit_for_bit(smollm2_quantized: Any) -> None:
    """Five sequences decoded with the stack and with the layer loop: the same logprobs,
    bits."""
    from support.decode_stack import both_ways

    from nanoserve.config import EngineConfig
    from nanoserve.tokenizer import Tokenizer

    model = smollm2_quantized
    tok = Tokenizer.from_folder(resolve_model("smollm2"))
    assert model.stack is not None
    assert set(model.stack.formats) == {"q4_1"}
    prompts = [list(range(1000 + i, 1040 + 7 * i)) for i in range(5)]
    stacked, looped, calls = both_ways(model, tok, prompts, 12,
                                       EngineConfig(num_blocks=128, max_model_len=1024))
    assert stacked == looped
    assert all(len(v) == 12 for v in stacked.values())
    assert calls == 11  # every step after the prefill


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_stream_read_reads_every_byte_once(isa: str) -> None:
    """The read-bandwidth yardstick (`nanoserve bench`) reads each byte of its buffer once,
    split among the kernels' threads: float32 ones viewed as bytes sum to their count (a
    thread that skipped its run, or read another's twice, would miss it)."""
    k = kernels_for(isa)
    ones = torch.ones(3 * 4096 * 16 + 5 * 16)  # whole vectors, not a whole grain of them
    assert k.ops.stream_read(ones.view(torch.uint8)) == ones.numel()


@pytest.mark.parametrize("isa", ISA_PARAMS)
@pytest.mark.parametrize(("rows", "suffix"), [(1, ""), (3, ""), (1, "+q8")])
def test_two_threads_compute_every_output_row(isa: str, rows: int, suffix: str) -> None:
    """Batch-1 products hand their output rows to the threads in shrinking runs
    (csrc/rows.h): 4,001 rows of 144 bytes make seven runs (1,000, 750, 562, three of the
    455-row minimum, a remainder of 324). Every row must come back (out starts as NaN), each
    the bits one thread gives, on the exact path (one row of x and three) and the 8-bit one.
    (Without the last run, every case here fails.)"""
    if suffix and isa == "generic":
        pytest.skip("the generic build has no 8-bit kernels")
    k = kernels_for(isa)
    g = torch.Generator().manual_seed(11)
    w = quantize(torch.randn(4001, 256, generator=g), "q4_0")
    assert w.blocks.shape[1] == 144
    x = torch.randn(rows, 256, generator=g)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = torch.full((rows, 4001), float("nan"))
            k.ops.quant_linear(x, w.blocks, "q4_0" + suffix, out)
            outs.append(out)
    finally:
        torch.set_num_threads(before)
    assert not outs[1].isnan().any()
    assert torch.equal(outs[0], outs[1])
