"""A Q8_0 LM head repacked into panels of 16 output rows (csrc/panels.cpp), for the decode
steps of many sequences.

The head is the largest multiply of a step with a large vocabulary: Gemma 3 270M's is
262,144 x 640 in Q8_0, 168 M weights against the layers' 100 M, and at 16 rows it took more
than half of a decode step through the tile kernel (quant.cpp). Laid out as panels, 16 rows'
weights side by side per k, the same values run at sgemm's speed. scripts/bench_kernels.py
--format q8_0 --head, ms for Gemma's head alone, tile kernel against panels, in one run:

    rows          1     4     5     8     9    16    32    64
    AVX-512    6.5  10.6  14.1  24.2  35.4  40.9  70.7   127   (tile)
               9.2  10.7  13.1  16.5  16.5  27.0  54.2   113   (panels)
    AVX2       7.3  11.5          27.4  27.9  38.7  65.6         (tile)
              14.8  16.4          20.4  20.6  37.6  64.4         (panels)

so panels take over from PANEL_FROM_ROWS rows, on the instruction sets measured. The panels
are a copy beside the blocks (which fewer rows and the embedding lookup still read): one
byte per weight and a float32 scale per 32, 189 MB for Gemma's head.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanoserve.model import unpack

PANEL = 16  # output rows side by side (csrc/panels.cpp's kPanel)
# From this many rows of x a weight runs on its panels, by instruction set; the generic
# build has no figures (it keeps no quantized weights under auto), so none there.
PANEL_FROM_ROWS = {"avx512": 5, "avx2": 8}


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
