"""A weight multiply, x [T, in] -> [T, out], in the fastest form the device offers.

On a CPU with MKL, in float32, the weight is pre-packed once (cblas_sgemm_pack) into the
panel layout the sgemm kernel reads: an ordinary sgemm packs its B operand again on every
call, which at decode sizes (T of 8 to 64 rows against a 576 x 3072 weight) costs about as
much as the multiply itself. Measured on this CPU with the 30 layers' weights cold in cache,
one thread: 1.3-1.7x faster at T = 16-32, 1.1-1.3x at 64-128, and the same bits as a plain
sgemm. At 2 to 8 rows packed is about 2x faster too (two threads, the 30 layers' weights
cold: 28-37 ms against 57-84 ms). One row is a gemv for MKL, which packs nothing, so it keeps
the plain path.
"""

from __future__ import annotations

import torch

from nanoserve.model.int8 import INT8_FROM_ROWS, Int8Weight


def _t(w: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [in, out], contiguous."""
    return w.t().contiguous()


def mkl_packing_available() -> bool:
    # `torch.ops.mkl._mkl_linear` is what Inductor's CPU freezing pass emits for float32
    # linears; private, hence the check rather than an assumption.
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


class Proj:
    """One projection. The plain form keeps the weight transposed, [in, out] and contiguous:
    `x @ W` beats `F.linear(x, W)` by 20-40% at decode batch sizes on this CPU (the same at
    prefill sizes). The packed form is a second copy of the weight: memory for speed.
    `int8` (model/int8.py, opt-in) takes over from INT8_FROM_ROWS rows."""

    __slots__ = ("weight", "packed", "int8")

    def __init__(self, weight: torch.Tensor, *, pack: bool) -> None:  # weight: [out, in]
        self.weight = _t(weight)  # [in, out]
        self.packed = (
            torch.ops.mkl._mkl_reorder_linear_weight(weight.contiguous(), 64) if pack else None
        )
        self.int8: Int8Weight | None = None

    def dense_weight(self) -> torch.Tensor:
        return self.weight.t()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None and x.shape[0] >= INT8_FROM_ROWS:
            return self.int8(x)
        if self.packed is None or x.shape[0] < 2:  # one row: MKL's gemv, no packing
            return x @ self.weight
        # (The [out, in] weight argument is what the op would fall back to; a view will do.)
        return torch.ops.mkl._mkl_linear(x, self.packed, self.weight.t(), None, x.shape[0])
