"""Quantized weights: GGUF's own block formats, kept as they are in the file, multiplied by
nanoserve's kernels (model/csrc/quant.cpp) with float32 activations.

`--quantization` (vLLM's flag) chooses them: `auto` keeps each tensor of a GGUF file in its
own format wherever a kernel exists (Q4_0, Q4_1, Q8_0) and dequantizes the rest; `none`
dequantizes everything to float32, as nanoserve always did; `q8_0`, `q4_0` or `q4_1`
quantizes every projection and the embedding to that format with gguf-py (llama.cpp's
reference quantizers), from whatever the source holds. Norms stay float32.

The weight values are exactly gguf-py's dequantization (so transformers', the reference's):
only the order of a dot product's additions differs from a float32 matmul over them.

Why not PyTorch's own weight-only ops: `_weight_int4pack_mm_for_cpu` (what torchao's CPU
int4 layout calls too) with float32 activations took 107.7 ms for the 30 layers' projections
at one row, against 35.7 ms for the packed float32 weights and 5.4-6.8 ms for these kernels,
and 20 to 40 times the float32 time at 4 to 64 rows; `_weight_int8pack_mm` has one scale
per output channel, where Q8_0 has one per 32 weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from nanoserve.model import native
from nanoserve.model.int8 import INT8_FROM_ROWS, Int8Weight
from nanoserve.model.native import Kernels

# Bytes of one block of 32 weights, by format.
BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34}
BLOCK = 32
CHOICES = ("auto", "none", "q8_0", "q4_0", "q4_1")


@dataclass(frozen=True, slots=True)
class QuantWeight:
    """A [rows, cols] weight as GGUF blocks: uint8 [rows, cols / 32 * BLOCK_BYTES[format]]."""

    blocks: torch.Tensor
    format: str
    cols: int

    @property
    def rows(self) -> int:
        return int(self.blocks.shape[0])

    def dequantize(self, kernels: Kernels | None = None) -> torch.Tensor:
        """[rows, cols] float32, by `kernels` (default: this CPU's; the same bits on every
        instruction set)."""
        out = torch.empty(self.rows, self.cols)
        _ops(kernels).dequantize(self.blocks, self.format, out)
        return out

    def take_rows(self, ids: torch.Tensor, kernels: Kernels | None = None) -> torch.Tensor:
        """Rows `ids`, dequantized: an embedding lookup. [T] -> [T, cols]."""
        out = torch.empty(ids.shape[0], self.cols)
        _ops(kernels).dequantize(self.blocks[ids], self.format, out)
        return out

    @staticmethod
    def cat(parts: list[QuantWeight]) -> QuantWeight:
        """Stacked along the rows (a fused projection); all in one format."""
        return QuantWeight(torch.cat([p.blocks for p in parts]), parts[0].format, parts[0].cols)


def _kernels(kernels: Kernels | None) -> Kernels:
    """`kernels`, else this CPU's; quantized weights cannot run without them."""
    k = kernels or native.kernels()
    if k is None:
        raise RuntimeError("quantized weights need nanoserve's native kernels (model/native.py)")
    return k


def _ops(kernels: Kernels | None) -> Any:
    return _kernels(kernels).ops


def quantize(weight: torch.Tensor, fmt: str) -> QuantWeight:
    """A float weight [rows, cols] in `fmt`, by gguf-py's quantizers (llama.cpp's)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    qtype = GGMLQuantizationType[fmt.upper()]
    blocks = gguf_quantize(weight.float().numpy(), qtype)
    return QuantWeight(torch.from_numpy(np.ascontiguousarray(blocks)), fmt, weight.shape[1])


# From this many rows a projection dequantizes its whole weight into a scratch buffer and
# multiplies with MKL's sgemm; below, nanoserve's kernel. Measured with the weights in cache,
# GFLOP/s, kernel against dequantize + sgemm: 32 rows 104-133 against 84-104, 64 rows
# 110-134 against 112-131, 128 rows 116-134 against 131-156, 512 rows 130-135 against
# 159-191 (for the 3072x576, 576x1536 and 960x576 projections).
DENSE_FROM_ROWS = 128
# The same threshold by instruction set (model/native.py), measured on each
# (scripts/bench_kernels.py): on AVX2 as on AVX-512 the kernel ties dequantize + sgemm at
# 128 rows and loses above; generic does not keep quantized weights under auto.
_DENSE_FROM_ROWS = {"avx512": DENSE_FROM_ROWS, "avx2": DENSE_FROM_ROWS,
                    "generic": DENSE_FROM_ROWS}


def dense_from_rows(isa: str) -> int:
    return _DENSE_FROM_ROWS[isa]


def quant_pays(isa: str) -> bool:
    """Whether `--quantization auto` keeps a GGUF's blocks under instruction set `isa`: only
    where its kernels beat float32 weights. The generic build (no AVX2: the compiler's
    scalar byte-to-float conversions) lost at every row count, so there auto dequantizes
    to float32 at load (SmolLM2's projections, ms, generic kernel against float32: 100 vs
    37 at one row, 129 vs 73 at eight, 348 vs 108 at 32); AVX2 and AVX-512 win 1.8-7x
    below 128 rows and tie above (scripts/bench_kernels.py)."""
    return isa != "generic"
# Up to this many rows the kernel dequantizes the weights in registers (csrc/quant.cpp's
# kRegisterRows); between it and DENSE_FROM_ROWS, a few weight rows at a time into L1. The
# cost model (sim/capacity/cost.py) prices a row in that middle band apart.
REGISTER_ROWS = 8


class Scratch:
    """One float32 buffer that every projection of a model dequantizes into in turn (a
    model's steps run one at a time): a fresh one per call would cost page faults."""

    def __init__(self) -> None:
        self._buf = torch.empty(0)

    def matrix(self, rows: int, cols: int) -> torch.Tensor:
        if self._buf.numel() < rows * cols:
            self._buf = torch.empty(rows * cols)
        return self._buf[: rows * cols].view(rows, cols)


class QuantProj:
    """A projection x [T, in] -> [T, out] over a quantized weight [out, in]: nanoserve's
    kernel (weights dequantized in registers, or a few rows at a time into L1) below
    DENSE_FROM_ROWS rows, the whole weight dequantized into `scratch` for MKL's sgemm from
    there. Either way the weights are the same values; only the order of additions differs.
    `int8` (model/int8.py, opt-in) takes over from INT8_FROM_ROWS rows."""

    __slots__ = ("weight", "scratch", "ops", "dense_from", "kernels", "int8")

    def __init__(self, weight: QuantWeight, scratch: Scratch | None = None,
                 kernels: Kernels | None = None) -> None:
        self.weight = weight
        self.scratch = scratch or Scratch()
        k = _kernels(kernels)
        self.ops = k.ops  # the instruction set's kernels it runs on
        self.dense_from = dense_from_rows(k.isa)
        self.kernels = k
        self.int8: Int8Weight | None = None

    def dense_weight(self) -> torch.Tensor:
        return self.weight.dequantize(self.kernels)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if self.int8 is not None and x.shape[0] >= INT8_FROM_ROWS:
            return self.int8(x)
        if x.stride(-1) != 1:
            x = x.contiguous()
        if x.shape[0] >= self.dense_from:
            dense = self.scratch.matrix(w.rows, w.cols)
            self.ops.dequantize(w.blocks, w.format, dense)
            return x @ dense.t()
        out = torch.empty(x.shape[0], w.rows, dtype=torch.float32, device=x.device)
        self.ops.quant_linear(x, w.blocks, w.format, out)
        return out
