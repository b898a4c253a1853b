"""Quantized weights: GGUF's own block formats, kept as they are in the file, multiplied by
nanoserve's kernels (model/csrc/quant.cpp) with float32 activations.

`--quantization` (vLLM's flag) chooses them: `auto` keeps each tensor of a GGUF file in its
own format wherever a kernel exists (FORMATS: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants
Q4_K, Q5_K and Q6_K, and F16 and BF16 matrices) and dequantizes the rest; `none`
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
from nanoserve.model.panels import PANEL_ROWS, Panels


@dataclass(frozen=True, slots=True)
class BlockFormat:
    """A block format's unit: a row of a weight is cols / weights blocks of `bytes` bytes."""

    weights: int
    bytes: int


# Every format with a kernel (csrc/quant.cpp). The K-quants' superblocks hold 256 weights;
# F16 and BF16 rows are plain 2-byte values, counted in blocks of 32 because the kernels
# take a row 32 weights at a time (a row must be a multiple of 32 long, as for the rest).
FORMATS = {
    "q4_0": BlockFormat(32, 18), "q4_1": BlockFormat(32, 20), "q5_0": BlockFormat(32, 22),
    "q5_1": BlockFormat(32, 24), "q8_0": BlockFormat(32, 34),
    "q4_k": BlockFormat(256, 144), "q5_k": BlockFormat(256, 176), "q6_k": BlockFormat(256, 210),
    "f16": BlockFormat(32, 64), "bf16": BlockFormat(32, 64),
}
# Bytes of one block (FORMATS[format].weights weights), by format: its keys are the formats
# with a kernel, what a GGUF's tensors are kept as (`frozenset(BLOCK_BYTES)`).
BLOCK_BYTES = {f: b.bytes for f, b in FORMATS.items()}
BLOCK = 32  # the kernels' unit: every format's block is a whole number of them
MIXED = "mixed"  # QuantWeight.format of a fused weight whose parts differ in format
CHOICES = ("auto", "none", "q8_0", "q4_0", "q4_1")


def row_bytes(fmt: str, cols: int) -> int:
    """Bytes of one row of `cols` weights in `fmt` (cols a multiple of its block)."""
    f = FORMATS[fmt]
    if cols % f.weights:
        raise ValueError(f"{fmt}: a row of {cols} weights is not a whole number of its "
                         f"{f.weights}-weight blocks")
    return cols // f.weights * f.bytes


@dataclass(frozen=True, slots=True)
class QuantWeight:
    """A [rows, cols] weight as GGUF blocks: uint8 [rows, row_bytes(format, cols)].

    A fused weight whose parts differ in format (Gemma 3's q and k in Q5_0, v in Q8_0) is
    `format` MIXED with `parts`, each part's rows after the previous part's; its `blocks` is
    every part's bytes in one flat uint8 buffer, the parts' blocks views of it (so
    blocks.nbytes is still the weight's size)."""

    blocks: torch.Tensor
    format: str
    cols: int
    parts: tuple[QuantWeight, ...] = ()

    @property
    def rows(self) -> int:
        if self.parts:
            return sum(p.rows for p in self.parts)
        return int(self.blocks.shape[0])

    def pieces(self) -> list[tuple[int, QuantWeight]]:
        """(first row, single-format weight) of each part; [(0, self)] when one format."""
        out, r = [], 0
        for p in self.parts or (self,):
            out.append((r, p))
            r += p.rows
        return out

    def dequantize_into(self, ops: Any, out: torch.Tensor) -> None:
        """Into out [rows, cols] float32 (rows may be a view's, `cols` apart or more)."""
        for r, p in self.pieces():
            ops.dequantize(p.blocks, p.format, out[r: r + p.rows])

    def dequantize(self, kernels: Kernels | None = None) -> torch.Tensor:
        """[rows, cols] float32, by `kernels` (default: this CPU's; the same bits on every
        instruction set)."""
        out = torch.empty(self.rows, self.cols)
        self.dequantize_into(_ops(kernels), out)
        return out

    def take_rows(self, ids: torch.Tensor, kernels: Kernels | None = None) -> torch.Tensor:
        """Rows `ids`, dequantized: an embedding lookup. [T] -> [T, cols]."""
        if self.parts:
            return self.dequantize(kernels)[ids]
        out = torch.empty(ids.shape[0], self.cols)
        _ops(kernels).dequantize(self.blocks[ids], self.format, out)
        return out

    @staticmethod
    def cat(parts: list[QuantWeight]) -> QuantWeight:
        """Stacked along the rows (a fused projection): one weight in their format where
        they share one, else a MIXED weight of the parts (each still in its own format)."""
        flat = [q for p in parts for _, q in p.pieces()]
        if len({p.format for p in flat}) == 1:
            return QuantWeight(torch.cat([p.blocks for p in flat]), flat[0].format,
                               flat[0].cols)
        buf = torch.cat([p.blocks.reshape(-1) for p in flat])
        views, at = [], 0
        for p in flat:
            n = p.blocks.numel()
            views.append(QuantWeight(buf[at: at + n].view(p.blocks.shape), p.format, p.cols))
            at += n
        return QuantWeight(buf, MIXED, flat[0].cols, tuple(views))


def _kernels(kernels: Kernels | None) -> Kernels:
    """`kernels`, else this CPU's; quantized weights cannot run without them."""
    k = kernels or native.kernels()
    if k is None:
        raise RuntimeError("quantized weights need nanoserve's native kernels (model/native.py)")
    return k


def _ops(kernels: Kernels | None) -> Any:
    return _kernels(kernels).ops


def quantize(weight: torch.Tensor, fmt: str) -> QuantWeight:
    """A float weight [rows, cols] in `fmt`, by gguf-py's quantizers (llama.cpp's). gguf-py
    has none for the K-quants (it only reads them): NotImplementedError there."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    row_bytes(fmt, weight.shape[1])  # a whole number of blocks, else ValueError
    qtype = GGMLQuantizationType[fmt.upper()]
    blocks = gguf_quantize(weight.float().numpy(), qtype)
    # F16 comes back as float16 values, the rest as their bytes: uint8 rows either way
    blocks = np.ascontiguousarray(blocks).view(np.uint8)
    return QuantWeight(torch.from_numpy(blocks), fmt, weight.shape[1])


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
# The same threshold serves every format. Measured for Q5_0 to BF16 with
# scripts/bench_kernels.py --format (Gemma 3 270M's four projection shapes, 18 layers' worth
# so that the weights stream from memory; one thread; float32 `x @ w.t()` over the same
# values in the same run), kernel / float32 speed on AVX-512 and AVX2: at one row Q5_0
# 2.0 / 1.7x, Q5_1 2.2 / 2.0x, Q4_K 2.7 / 2.6x, Q5_K 2.0 / 1.7x, Q6_K 1.9 / 1.7x, F16
# 2.9 / 3.0x, BF16 2.6 / 2.8x; 1.0-1.6x from 8 to 64 rows (BF16 on AVX2 0.98x at 64 rows,
# F16 1.05x at 8: they save only half the bytes); at 128 rows 0.89-1.02x, where dequantize +
# sgemm is 0.95-1.01x. With one layer's weights only (21 MB as float32, inside the 32 MB
# L3) float32 wins at one row against Q5_0 to Q6_K (0.5-0.95x): once the bytes are cached
# the dequantizing is the cost, the K-quants' most (two vectors of bits per Q5_K or Q6_K
# vector).


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


def row_path(rows: int, isa: str | None) -> str:
    """The kernel a quantized projection multiplies `rows` rows of x with under `isa`, as
    QuantProj.__call__ picks it for a projection with panels: "register", "tile", "panels"
    or "dense". `isa` None is the dispatch before panels (for cost models measured then)."""
    if isa is not None and rows in PANEL_ROWS.get(isa, range(0)):
        return "panels"
    if rows >= (DENSE_FROM_ROWS if isa is None else dense_from_rows(isa)):
        return "dense"
    return "register" if rows <= REGISTER_ROWS else "tile"


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
    `int8` (model/int8.py, opt-in) takes over from INT8_FROM_ROWS rows, and the panels
    (model/panels.py, `with_panels`) at the row counts of `panel_rows` below that. `act8`
    ("+q8" or "+q8v", opt-in: LlamaModel.use_act8) sends one row of x to the kernels' 8-bit
    activations (csrc/q8dot.cpp) in the formats they have."""

    __slots__ = ("weight", "scratch", "ops", "dense_from", "kernels", "int8", "pieces",
                 "panels", "panel_rows", "act8")

    def __init__(self, weight: QuantWeight, scratch: Scratch | None = None,
                 kernels: Kernels | None = None) -> None:
        self.weight = weight
        self.scratch = scratch or Scratch()
        k = _kernels(kernels)
        self.ops = k.ops  # the instruction set's kernels it runs on
        self.dense_from = dense_from_rows(k.isa)
        self.kernels = k
        self.int8: Int8Weight | None = None
        self.pieces = weight.pieces()  # once, not on every call of a decode step
        self.panels: tuple[Panels, ...] = ()  # one per piece, or none
        self.panel_rows = range(0)
        self.act8 = ""

    def with_panels(self) -> QuantProj:
        """This projection on panels at the rows of PANEL_ROWS, where its instruction set
        has them and every piece can be laid out as panels; else as it was."""
        if self.kernels.isa not in PANEL_ROWS:
            return self
        panels = [Panels.of(p.format, p.blocks, p.cols) for _, p in self.pieces]
        if all(p is not None for p in panels):
            self.panels = tuple(p for p in panels if p is not None)
            self.panel_rows = PANEL_ROWS[self.kernels.isa]
        return self

    def dense_weight(self) -> torch.Tensor:
        return self.weight.dequantize(self.kernels)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if self.int8 is not None and x.shape[0] >= INT8_FROM_ROWS:
            return self.int8(x)
        if x.stride(-1) != 1:
            x = x.contiguous()
        if self.panels and x.shape[0] in self.panel_rows:
            out = torch.empty(x.shape[0], w.rows, dtype=torch.float32, device=x.device)
            for (r, p), panels in zip(self.pieces, self.panels, strict=True):
                panels(self.ops, x, out[:, r: r + p.rows])
            return out
        if x.shape[0] >= self.dense_from:
            dense = self.scratch.matrix(w.rows, w.cols)
            w.dequantize_into(self.ops, dense)  # a mixed weight: each part into its rows
            return x @ dense.t()
        out = torch.empty(x.shape[0], w.rows, dtype=torch.float32, device=x.device)
        # A mixed weight: each part's kernel writes its own columns of the one output (the
        # kernel takes the output's row stride), the same values as that part alone.
        for r, p in self.pieces:
            self.ops.quant_linear(x, p.blocks, p.format + self.act8, out[:, r: r + p.rows])
        return out
