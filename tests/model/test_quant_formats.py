"""The block formats beyond Q4_0, Q4_1 and Q8_0 (model/quant.py, csrc/quant.cpp): Q5_0, Q5_1,
the K-quants Q4_K, Q5_K and Q6_K, and F16 and BF16 rows. In each instruction set's build
(those this CPU lacks skip): the dequantized weights are exactly gguf-py's, bit for bit, on
random blocks with extreme scales; the multiply is a matmul over those values up to the
order of additions at every path's row counts; and a fused projection whose parts differ in
format equals its parts' outputs side by side. Small shapes: the whole file runs in seconds.

gguf-py quantizes only some of these formats (none of the K-quants), and bit-exactness is
about reading any block, so the blocks are random bytes with their f16 scales set apart."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from support.native_check import ISA_PARAMS, kernels_for

from nanoserve.model import native
from nanoserve.model.parallel.shard import cols as shard_cols
from nanoserve.model.placement import Placement, _fused
from nanoserve.model.quant import (
    FORMATS,
    MIXED,
    QuantProj,
    QuantWeight,
    quantize,
    row_bytes,
)

pytestmark = pytest.mark.skipif(not native.available(), reason="needs the native kernels")

NEW = ("q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "f16", "bf16")
# Byte offsets of each block's f16 scales (d, then m or dmin where the format has one).
HALVES = {"q5_0": (0,), "q5_1": (0, 2), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,),
          "q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2)}  # the last three: for test_panels


def reference(w: QuantWeight) -> torch.Tensor:
    qtype = GGMLQuantizationType[w.format.upper()]
    return torch.from_numpy(np.array(gguf_dequantize(w.blocks.numpy(), qtype),
                                     dtype=np.float32)).reshape(w.rows, w.cols)


def _halves(n: int, rng: np.random.Generator, extreme: bool) -> np.ndarray:
    """n finite f16 values as bytes [n, 2]: small normals, and with `extreme` also
    subnormals, zeros, negatives and the largest half."""
    h = (rng.standard_normal(n) * 0.01).astype(np.float16)
    if extreme:
        pick = rng.integers(0, 5, n)
        h = np.where(pick == 1, rng.integers(1, 0x400, n).astype(np.uint16).view(np.float16), h)
        h = np.where(pick == 2, np.float16(0), h)
        h = np.where(pick == 3, np.float16(-65504), h)
        h = np.where(pick == 4, np.float16(65504), h)
    return np.ascontiguousarray(h.astype(np.float16)).view(np.uint8).reshape(n, 2)


def random_weight(fmt: str, rows: int, cols: int, seed: int, extreme: bool = False
                  ) -> QuantWeight:
    """[rows, cols] in `fmt` from random bytes: every quant bit pattern, scales controlled
    (finite: an infinite scale times a zero quant is NaN, which equals nothing)."""
    rng = np.random.default_rng(seed)
    if fmt == "f16":
        v = (rng.standard_normal((rows, cols)) * 0.1).astype(np.float16)
        if extreme:  # subnormals, signed zero and infinities
            v.reshape(-1)[:6] = np.array([6e-8, -6e-8, 3e-5, -0.0, np.inf, -np.inf])
        data = v.view(np.uint8)
    elif fmt == "bf16":
        bits = rng.integers(0, 1 << 16, (rows, cols), dtype=np.uint16)
        if not extreme:  # values near one: exponent bits from a narrow band
            bits = (bits & 0x807F) | (rng.integers(0x3C, 0x40, (rows, cols)) << 7).astype(
                np.uint16)
        nan = (bits & 0x7F80) == 0x7F80
        bits[nan] &= 0xFF80  # NaN -> infinity (finite parts kept: subnormals, huge values)
        data = bits.view(np.uint8)
    else:
        f = FORMATS[fmt]
        n = rows * cols // f.weights
        blocks = rng.integers(0, 256, (n, f.bytes), dtype=np.uint8)
        for at in HALVES[fmt]:
            blocks[:, at: at + 2] = _halves(n, rng, extreme)
        data = blocks.reshape(rows, -1)
    out = QuantWeight(torch.from_numpy(np.ascontiguousarray(data)), fmt, cols)
    assert out.blocks.shape == (rows, row_bytes(fmt, cols))
    return out


@pytest.mark.parametrize("isa", ISA_PARAMS)
@pytest.mark.parametrize("fmt", NEW)
def test_dequantize_is_bit_exact_with_gguf_py(fmt: str, isa: str) -> None:
    k = kernels_for(isa)
    w = random_weight(fmt, 9, 512, seed=1, extreme=True)
    want = reference(w)
    assert torch.equal(w.dequantize(k), want)
    ids = torch.tensor([4, 0, 8, 4])
    assert torch.equal(w.take_rows(ids, k), want[ids])
    # and with the moderate scales real files have
    mild = random_weight(fmt, 3, 256, seed=2)
    assert torch.equal(mild.dequantize(k), reference(mild))


@pytest.mark.parametrize("fmt", ["q5_0", "q5_1", "f16", "bf16"])
def test_quantize_writes_gguf_py_blocks(fmt: str) -> None:
    """Formats gguf-py quantizes come back as uint8 rows its dequantizer reads; the
    K-quants, which it cannot quantize, say so."""
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    w = quantize(x, fmt)
    assert w.blocks.dtype == torch.uint8
    assert w.blocks.shape == (4, row_bytes(fmt, 64))
    assert torch.equal(w.dequantize(), reference(w))
    if fmt == "f16":
        assert torch.equal(w.dequantize(), x.half().float())
    with pytest.raises(NotImplementedError):
        quantize(torch.zeros(2, 256), "q4_k")


@pytest.mark.parametrize("isa", ISA_PARAMS)
@pytest.mark.parametrize("fmt", NEW)
def test_linear_is_a_matmul_over_the_same_values(fmt: str, isa: str) -> None:
    """Registers (1, 3, 8 rows), L1 tiles (9, 13), dequantize + sgemm (130): within float32
    rounding of the float64 product, and in the tile band a row's bits do not depend on the
    rows beside it."""
    k = kernels_for(isa)
    cols = 512
    w = random_weight(fmt, 19, cols, seed=3)  # 19 rows: not a multiple of 3 or 4
    ref = reference(w).double()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(130, cols, generator=g)
    proj = QuantProj(w, kernels=k)
    outs = {}
    for rows in (1, 3, 8, 9, 13, 130):
        got = proj(x[:rows])
        assert got.shape == (rows, 19)
        want = x[:rows].double() @ ref.t()
        # each sum's rounding, at most K float32 ulps of the sum of magnitudes
        bound = (x[:rows].double().abs() @ ref.abs().t()) * cols * 2.0**-23 + 1e-30
        assert ((got.double() - want).abs() <= bound).all(), rows
        outs[rows] = got
    assert torch.equal(outs[9], outs[13][:9])  # the tile micro-kernel: one chain per dot
    strided = torch.randn(5, cols + 64, generator=g)[:, 32: 32 + cols]  # rows apart
    assert torch.equal(proj(strided), proj(strided.contiguous()))


def _mixed_parts(seed: int) -> list[QuantWeight]:
    # Gemma 3's Q4_K_M: q and k in Q5_0, v in Q8_0; and K-quant and F16 parts besides
    shapes = [("q5_0", 16), ("q5_0", 8), ("q8_0", 8), ("q6_k", 5), ("f16", 3), ("q4_k", 7)]
    parts = [random_weight(f, n, 256, seed + i) for i, (f, n) in enumerate(shapes)
             if f != "q8_0"]
    q8 = quantize(torch.randn(8, 256, generator=torch.Generator().manual_seed(seed)), "q8_0")
    parts.insert(2, q8)
    return parts


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_a_fused_projection_of_mixed_formats_is_its_parts_side_by_side(isa: str) -> None:
    k = kernels_for(isa)
    parts = _mixed_parts(seed=5)
    where = Placement(device=torch.device("cpu"), dtype=torch.float32, kernels=k,
                      quantized=True, pack_weights=False)
    fused = _fused(list(parts), QuantProj(parts[0], kernels=k).scratch, where)
    assert isinstance(fused, QuantProj)
    w = fused.weight
    assert w.format == MIXED
    assert [p.format for p in w.parts] == [p.format for p in parts]
    assert w.rows == sum(p.rows for p in parts)
    assert w.cols == 256
    assert w.blocks.nbytes == sum(p.blocks.nbytes for p in parts)  # llama.py's weight_bytes
    assert torch.equal(w.dequantize(k), torch.cat([p.dequantize(k) for p in parts]))
    assert torch.equal(fused.dense_weight(), w.dequantize(k))
    x = torch.randn(130, 256, generator=torch.Generator().manual_seed(6))
    for rows in (1, 8, 9, 13):  # the kernels: each part's columns are that part's output
        alone = torch.cat([QuantProj(p, kernels=k)(x[:rows]) for p in parts], dim=1)
        assert torch.equal(fused(x[:rows]), alone), rows
    # the dense path: every part dequantized into its rows of one matrix, one sgemm
    assert torch.equal(fused(x), x @ w.dequantize(k).t())
    # fusing parts of one format still gives one weight in it (the decode stack's kind)
    same = _fused([parts[0], parts[1]], fused.scratch, where)
    assert isinstance(same, QuantProj)
    assert same.weight.format == "q5_0"
    assert not same.weight.parts


def test_a_mixed_projection_enters_the_decode_stack_as_its_pieces() -> None:
    from nanoserve.model.placement import LayerWeights, decode_stack_weights

    k = kernels_for(native.isa())
    parts = _mixed_parts(seed=7)
    mixed = QuantProj(QuantWeight.cat(parts[:3]), kernels=k)
    one = QuantProj(parts[0], kernels=k)
    norm = torch.ones(256)

    def layer(qkv: QuantProj) -> LayerWeights:
        return LayerWeights(attn_norm=norm, qkv=qkv, o=one, mlp_norm=norm, gate_up=one,
                            down=one)

    stack = decode_stack_weights([layer(one), layer(mixed)], usable=True)
    assert stack is not None
    # qkv, o, gate_up and down of each layer: the mixed qkv is three pieces, in row order
    assert stack.counts == [1, 1, 1, 1, 3, 1, 1, 1]
    assert stack.formats[4:7] == [p.format for p in parts[:3]]
    assert [b.data_ptr() for b in stack.blocks[4:7]] == [p.blocks.data_ptr() for p in
                                                        mixed.weight.parts]
    assert stack.q_norm == []
    assert stack.post_mlp_norm == []
    assert decode_stack_weights([layer(mixed)], usable=False) is None


@pytest.mark.parametrize("fmt", ["f16", "bf16"])
def test_a_gguf_float_tensor_as_uint8_rows_runs(fmt: str, tmp_path: Path) -> None:
    """An F16 or BF16 matrix of a GGUF, its bytes viewed as uint8 rows of 2 K bytes (as
    model/gguf.py keeps them), is a QuantWeight its format's kernel reads."""
    rows, cols = 6, 64
    values = torch.randn(rows, cols, generator=torch.Generator().manual_seed(8))
    path = tmp_path / "t.gguf"
    writer = GGUFWriter(str(path), "llama")
    if fmt == "f16":
        writer.add_tensor("w", values.numpy().astype(np.float16))
    else:
        blocks = quantize(values, "bf16").blocks.numpy()
        writer.add_tensor("w", blocks, raw_dtype=GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    t = GGUFReader(str(path)).tensors[0]
    assert t.tensor_type.name.lower() == fmt
    data = np.ascontiguousarray(t.data).view(np.uint8).reshape(rows, -1)
    w = QuantWeight(torch.from_numpy(data.copy()), fmt, cols)
    assert w.blocks.shape == (rows, 2 * cols)
    want = torch.from_numpy(np.array(gguf_dequantize(t.data, t.tensor_type),
                                     dtype=np.float32)).reshape(rows, cols)
    assert torch.equal(w.dequantize(), want)
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(9))
    got = QuantProj(w)(x)
    assert torch.allclose(got.double(), x.double() @ want.double().t(), atol=1e-4)


def test_k_quant_columns_shard_on_superblocks() -> None:
    """A row-parallel split (o, down) cuts a K-quant's columns at 256-weight superblocks;
    a cut inside one dequantizes that weight to float32, as for any block format."""
    w = random_weight("q4_k", 4, 1024, seed=10)
    dense = w.dequantize()
    half = shard_cols(w, 512, 1024)
    assert isinstance(half, QuantWeight)
    assert half.cols == 512
    assert half.blocks.shape == (4, row_bytes("q4_k", 512))
    assert torch.equal(half.dequantize(), dense[:, 512:])
    inside = shard_cols(w, 128, 640)
    assert isinstance(inside, torch.Tensor)
    assert torch.equal(inside, dense[:, 128:640])
