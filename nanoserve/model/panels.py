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

import torch

PANEL = 16  # output rows side by side (csrc/panels.cpp's kPanel)
_Q8_BLOCK, _Q8_BYTES = 32, 34  # Q8_0: an f16 scale, then 32 int8 quants
# From this many rows of x the head runs on its panels, by instruction set; the generic
# build has no figures (it keeps no quantized weights under auto), so none there.
PANEL_FROM_ROWS = {"avx512": 5, "avx2": 8}


@dataclass(frozen=True, slots=True)
class Q8Panels:
    """A Q8_0 weight [rows, cols] as panels: q int8 [rows / 16, cols, 16], the quant of
    output row 16 p + i at column k in q[p, k, i]; scales float32 [rows / 16, cols / 32,
    16], that row's block scale (its f16 d, exact). The values are the blocks' own."""

    q: torch.Tensor
    scales: torch.Tensor

    @staticmethod
    def of(fmt: str, blocks: torch.Tensor, cols: int) -> Q8Panels | None:
        """The panels of a weight of `cols` columns in format `fmt` (a QuantWeight's
        blocks [rows, row bytes]), or None where it is not Q8_0 of whole panels."""
        if fmt != "q8_0" or blocks.shape[0] % PANEL:
            return None
        n, k = blocks.shape[0], cols
        b = blocks.view(n, k // _Q8_BLOCK, _Q8_BYTES)
        d = b[:, :, :2].contiguous().view(torch.float16).float()  # [n, k / 32]
        q = b[:, :, 2:].contiguous().view(torch.int8).view(n // PANEL, PANEL, k)
        return Q8Panels(q.permute(0, 2, 1).contiguous(),
                        d.view(n // PANEL, PANEL, k // _Q8_BLOCK).permute(0, 2, 1).contiguous())

    def __call__(self, ops: object, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], self.q.shape[0] * PANEL, dtype=torch.float32)
        ops.q8_panel_linear(x, self.q, self.scales, out)  # type: ignore[attr-defined]
        return out
