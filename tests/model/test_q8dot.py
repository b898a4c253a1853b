"""The 8-bit-activation batch-1 kernels (csrc/q8dot.cpp, `--int8-activations`): the one row
of x rounded to int8 with a scale per 32 values (per 256 for Q4_K and Q6_K, as llama.cpp's
Q8_K), each weight's quants multiplied by those in integer dot products, each unit's offset
by the exact float32 sum of x it multiplies (Q6_K's by the rounded x, in the same integers).

The reference below computes exactly that in float64 from gguf-py's dequantization: a
weight w = s q + o splits into its offset o (the same block with every quant zero) and its
scaled quant w - o; the first multiplies x, the second x's int8 rounding (Q6_K: all of w
multiplies the rounding)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from support.native_check import ISA_PARAMS, kernels_for
from test_quant_formats import random_weight

from nanoserve.model import native
from nanoserve.model.base import ForwardBatch
from nanoserve.model.llama import LlamaModel
from nanoserve.model.quant import QuantWeight

pytestmark = pytest.mark.skipif(not native.available(), reason="needs the native kernels")

FORMATS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q6_k")
# Each format's quant bytes within a block (the rest are its scales).
QUANT_BYTES = {"q4_0": slice(2, 18), "q4_1": slice(4, 20), "q5_0": slice(2, 22),
               "q5_1": slice(4, 24), "q8_0": slice(2, 34),
               "q4_k": slice(16, 144), "q6_k": slice(0, 192)}
VNNI = {"avx512": "avx512_vnni", "avx2": "avx_vnni"}


def _dequant(blocks: np.ndarray, fmt: str, rows: int) -> np.ndarray:
    out = gguf_dequantize(blocks, GGMLQuantizationType[fmt.upper()])
    return np.asarray(out, dtype=np.float64).reshape(rows, -1)


def round_activations(x: np.ndarray, group: int = 32) -> np.ndarray:
    """x [K] float32 as the kernels round it: per `group`, the largest magnitude to 127
    (float32 arithmetic, ties to even); returns the rounded values times their scale, in
    float64."""
    b = x.reshape(-1, group)
    amax = np.abs(b).max(axis=1, keepdims=True)
    dx = amax / np.float32(127)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), np.float32(0))
    q = np.rint((b * inv.astype(np.float32)).astype(np.float32))
    assert np.abs(q).max() <= 127
    return (q.astype(np.float64) * dx.astype(np.float64)).reshape(-1)


def expected(w: QuantWeight, x: np.ndarray) -> np.ndarray:
    blocks = w.blocks.numpy()
    size = {"q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "q8_0": 34, "q4_k": 144,
            "q6_k": 210}[w.format]
    per = blocks.reshape(-1, size).copy()
    dense = _dequant(blocks, w.format, w.rows)
    per[:, QUANT_BYTES[w.format]] = 0
    offset = _dequant(per.reshape(w.rows, -1), w.format, w.rows)
    xd = x.astype(np.float64)
    if w.format == "q6_k":  # its offset (-32 d sc) in the integer sums: all of w on rounded x
        return dense @ round_activations(x, 256)
    group = 256 if w.format == "q4_k" else 32
    return (dense - offset) @ round_activations(x, group) + offset @ xd


def _run(k: native.Kernels, w: QuantWeight, x: torch.Tensor, suffix: str) -> torch.Tensor:
    out = torch.empty(1, w.rows)
    k.ops.quant_linear(x, w.blocks, w.format + suffix, out)
    return out[0]


@pytest.mark.parametrize("isa", ISA_PARAMS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_int8_decode_is_the_integer_dot_of_the_rounded_row(fmt: str, isa: str) -> None:
    if isa == "generic":
        pytest.skip("the generic build has no 8-bit kernels (model/int8.py asks none of it)")
    k = kernels_for(isa)
    # 31 blocks of 32: three groups of eight and a tail of seven taken one by one
    cols = 1024 if fmt in ("q4_k", "q6_k") else 992
    w = random_weight(fmt, 37, cols, seed=3)
    x = torch.randn(1, cols) * torch.linspace(0.1, 3.0, cols)
    x[0, :32] = 0.0  # a block of zeros: scale 0, nothing divided by it
    got = _run(k, w, x, "+q8").double().numpy()
    want = expected(w, x[0].numpy())
    scale = np.abs(_dequant(w.blocks.numpy(), fmt, w.rows)) @ np.abs(x[0].numpy())
    assert np.all(np.abs(got - want) <= 2e-6 * scale + 1e-30), np.abs(got - want).max()
    # and near the exact float32 path, as 8 bits of x allow
    exact = _run(k, w, x, "").double().numpy()
    assert np.all(np.abs(got - exact) <= 0.02 * scale)
    assert not np.array_equal(got, exact)


@pytest.mark.parametrize("fmt", FORMATS)
def test_vnni_gives_the_same_bits_and_the_instruction_sets_the_same_sums(fmt: str) -> None:
    """vpdpbusd and vpmaddubsw (vpdpwssd and vpmaddwd) form the same integer sums, so within
    a build VNNI changes no bit; across builds the float work is the same 256-bit code, and
    Q4_K's integer lanes hold the same sums however each build forms them: the same bits."""
    w = random_weight(fmt, 19, 512, seed=5)
    x = torch.randn(1, 512)
    runs = {}
    for isa in native.supported():
        if isa == "generic":
            continue
        k = kernels_for(isa)
        runs[isa] = _run(k, w, x, "+q8")
        if VNNI[isa] in native.cpu_flags():  # forced: the CPU has it
            assert torch.equal(_run(k, w, x, "+q8v"), runs[isa]), isa
    assert runs, "no instruction set with the 8-bit kernels on this CPU"
    first = next(iter(runs.values()))
    for name, out in runs.items():
        assert torch.equal(out, first), name


def test_more_rows_and_other_formats_keep_the_exact_path() -> None:
    k = kernels_for(native.supported()[0])
    w = random_weight("q4_0", 8, 256, seed=7)
    x = torch.randn(3, 256)
    plain = torch.empty(3, 8)
    k.ops.quant_linear(x, w.blocks, "q4_0", plain)
    suffixed = torch.empty(3, 8)
    k.ops.quant_linear(x, w.blocks, "q4_0+q8", suffixed)
    assert torch.equal(plain, suffixed)
    w5 = random_weight("q5_k", 8, 256, seed=7)
    one = x[:1]
    a, b = torch.empty(1, 8), torch.empty(1, 8)
    k.ops.quant_linear(one, w5.blocks, "q5_k", a)
    k.ops.quant_linear(one, w5.blocks, "q5_k+q8", b)
    assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="unknown suffix"):
        k.ops.quant_linear(one, w.blocks, "q4_0+q9", a)


def _step(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    """The prompt ids[:-1] prefilled, then the logits of one batch-1 step on ids[-1]."""
    n = len(ids)
    model.init_kv_cache(1, 16)
    with torch.inference_mode():
        model.forward(ForwardBatch(
            input_ids=ids[:-1], positions=list(range(n - 1)), slot_mapping=list(range(n - 1)),
            query_lens=[n - 1], context_lens=[n - 1], block_tables=[[0]],
            logits_indices=[n - 2]))
        return model.forward(ForwardBatch(
            input_ids=ids[-1:], positions=[n - 1], slot_mapping=[n - 1], query_lens=[1],
            context_lens=[n], block_tables=[[0]], logits_indices=[0]))[0].float()


def test_a_batch1_step_on_8bit_activations(smollm2_quantized: LlamaModel) -> None:
    """SmolLM2's Q4_1 layers and Q8_0 head: every projection takes the suffix, in the decode
    stack as in the per-layer path (the same bits), near the exact step, and back to it."""
    model = smollm2_quantized
    assert model.kernels is not None
    assert model.stack is not None
    suffix = native.act8_suffix(model.kernels.isa)
    if not suffix:
        pytest.skip("the generic build has no 8-bit kernels")
    ids = [1, 504, 3458, 314, 260, 1345, 282, 4811, 30]
    exact = _step(model, ids)
    try:
        assert model.use_act8(suffix) == 1 + 4 * len(model.layers)
        assert model.stack is not None
        assert all(f.endswith(suffix) for f in model.stack.formats)
        stacked = _step(model, ids)
        stack, model.stack = model.stack, None  # the per-layer path, the same kernels
        try:
            layered = _step(model, ids)
        finally:
            model.stack = stack
        assert torch.equal(stacked, layered)
        assert not torch.equal(stacked, exact)
        p, q = torch.log_softmax(exact, -1), torch.log_softmax(stacked, -1)
        assert (p.exp() * (p - q)).sum() < 0.05  # nats
    finally:
        model.use_act8("")
    assert not any("+" in f for f in model.stack.formats)
    assert torch.equal(_step(model, ids), exact)
