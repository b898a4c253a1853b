"""Quantized weights repacked into panels of 16 output rows (csrc/panels.cpp), for steps of
more than a few rows: decode at many sequences, and prefill.

quant.cpp's tile kernel takes a GGUF row's blocks as they lie and reduces each output's
vector of partial sums at the end; from a few rows on, the reductions and its L1 buffer are a
third of the work. As panels, every weight taken apart into its int8 quant and its group's
scale and offset (model/unpack.py: exact, w = s * q + o as gguf-py computes it) and 16 rows'
quants side by side per k, the same values run at sgemm's speed. Measured on Gemma 3 270M
Q4_K_M (AVX-512 host, one run each, the kernels against panels):

- the LM head (262,144 x 640, Q8_0: 168 M weights against the layers' 100 M), ms:

      rows          1     4     5     8     9    16    32    64
      AVX-512    6.5  10.6  14.1  24.2  35.4  40.9  70.7   127   (tile)
                 9.2  10.7  13.1  16.5  16.5  27.0  54.2   113   (panels)
      AVX2       7.3  11.5          27.4  27.9  38.7  65.6         (tile)
                14.8  16.4          20.4  20.6  37.6  64.4         (panels)

- the 18 layers' projections (Q5_0, Q8_0, Q4_K, Q6_K), ms, kernels (dequantize + sgemm from
  128 rows) against panels:

      rows          5     8    16    32    64   128   512
      AVX-512    11.2  17.2  25.3  42.4  74.8   172   561
                 10.6  13.1  20.0  37.3  71.8   144   564
      AVX2             19.2  25.2  40.6  72.3   175   554
                       15.1  26.4  44.3  86.8   167   662

so panels run the rows of PANEL_ROWS, by instruction set: on AVX-512 from 5 rows up (at
512 they tie dequantize + sgemm, and spare its scratch matrix); on AVX2 only up to 12, the
rows one pass of its 16 registers holds (each further pass dequantizes the weights again).
Batch-1 decode keeps the blocks (it reads every weight byte once: panels, a byte per weight,
read more). The panels are a copy beside the blocks (which fewer rows and the embedding lookup
still read): a byte per weight and 4 or 8 bytes per 16, 341 MB for Gemma 3 270M's head and
layers. F16 and BF16 weights have none.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanoserve.model import unpack

PANEL = 16  # output rows side by side (csrc/panels.cpp's kPanel)
# The rows of x a weight runs on its panels at, by instruction set; the generic build has
# no figures (it keeps no quantized weights under auto), so none there.
PANEL_ROWS = {"avx512": range(5, 1 << 62), "avx2": range(8, 13)}
# The rows of x one pass over the panels multiplies (csrc/panels.cpp's kRows): each further
# pass dequantizes every weight again, so a projection's time steps up every X_ROWS rows
# (measured, SmolLM2 decode steps, one thread: 54.4 ms at 16 rows, 64.4 at 17; 105.6 at 32,
# 115.9 at 33), which the cost model prices (sim/capacity/cost.py's panel_blocks).
X_ROWS = {"avx512": 16, "avx2": 12}


@dataclass(frozen=True, slots=True)
class Panels:
    """A quantized weight [rows, cols] as panels: q int8 [rows / 16, cols, 16], the quant of
    output row 16 p + i at column k in q[p, k, i]; scales and offsets float32 [rows / 16,
    cols / 16, 16], that row's group of 16 columns' s and o (offsets None for a symmetric
    format), w = s * q + o exactly as the blocks dequantize (model/unpack.py)."""

    q: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None

    @staticmethod
    def of(fmt: str, blocks: torch.Tensor, cols: int) -> Panels | None:
        """The panels of a weight of `cols` columns in format `fmt` (a QuantWeight's
        blocks [rows, row bytes]), or None where the format has no panels (F16, BF16) or
        the rows are not whole panels."""
        if fmt not in unpack.FORMATS or blocks.shape[0] % PANEL:
            return None
        q, s, o = unpack.unpack(fmt, blocks.numpy(), cols)
        return Panels(_side_by_side(q), _side_by_side(s),
                      None if o is None else _side_by_side(o))

    def __call__(self, ops: object, x: torch.Tensor, out: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """x [M, cols] @ W^T into `out` [M, rows] (a view with unit column stride will
        do), or a new tensor."""
        if out is None:
            out = torch.empty(x.shape[0], self.q.shape[0] * PANEL, dtype=torch.float32)
        ops.panel_linear(x, self.q, self.scales, self.offsets, out)  # type: ignore[attr-defined]
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.q, self.scales, self.offsets) if t is not None)


def _side_by_side(a: np.ndarray) -> torch.Tensor:
    """[rows, n] -> [rows / 16, n, 16]: each panel's 16 rows side by side."""
    rows, n = a.shape
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.view(rows // PANEL, PANEL, n).permute(0, 2, 1).contiguous()
