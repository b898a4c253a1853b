"""8-bit activations for the large multiplies, opt-in (`--int8-activations`).

llama.cpp multiplies its 4-bit weights by activations it has rounded to 8 bits (Q4 x Q8 dot
products); nanoserve's default keeps float32 activations, so its tokens are the reference's
to the bit. This mode trades that identity for speed where the CPU spends most of an
offline run: the projections of a step with many rows (a prompt's prefill), where the
default dequantizes the weight and calls MKL's sgemm. There it rounds each row of the
activations to int8 with its own scale (the row's largest magnitude maps to 127), multiplies
by an int8 copy of the weight with one scale per output channel through PyTorch's own
int8 GEMM (`torch._int_mm`), and scales the int32 sums back. Rows below `INT8_FROM_ROWS`
(decode) keep their exact path. That GEMM is oneDNN's only where PyTorch sends it there
(the AVX-512 VNNI hosts); elsewhere it is a plain loop, on a Zen 3 (AVX2, no VNNI) 0.6
GOP/s against sgemm's 28 at 128 x 2048 x 2048, so `int8_gemm_pays` measures it once and
the prefill keeps its exact path where it loses.

The int8 weight is made once, at load, from the weight's exact values (a GGUF block's
dequantization), so it costs one byte per weight beside the blocks. Accuracy is measured,
not assumed: scripts/int8_kl.py reports the KL divergence of the next-token distributions
from the exact path over a public-domain text.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from nanoserve.model.base import ForwardBatch, Model

# From this many rows a projection takes the int8 path (the rows where the default
# dequantizes into sgemm: quant.DENSE_FROM_ROWS); fewer rows keep their exact kernels.
INT8_FROM_ROWS = 128
_QMAX = 127.0
_TINY = torch.finfo(torch.float32).tiny
# SmoothQuant's migration strength: how much of an input channel's range moves from the
# activations into the weights (0.5 splits it evenly, the paper's choice for most models).
ALPHA = 0.5


class Int8Weight:
    """A weight [out, in] as int8 [in, out] with one float32 scale per output channel, after
    SmoothQuant's per-input-channel smoothing: x @ W.T = (x / s) @ (W * s).T, with s chosen
    from the activations' range on a calibration text, so that the few input channels
    where a Llama's activations run 10-100x larger than the rest (after the norms, before
    the down projection) do not take every other channel's 8 bits."""

    __slots__ = ("q", "scale", "inv_smooth")

    def __init__(self, dense: torch.Tensor, act_max: torch.Tensor) -> None:
        # dense: [out, in] float32; act_max: [in], each input channel's largest |x|
        w_max = dense.abs().amax(dim=0).clamp_min(_TINY)
        smooth = (act_max.clamp_min(_TINY) ** ALPHA / w_max ** (1 - ALPHA)).clamp_min(1e-5)
        self.inv_smooth = (1.0 / smooth).contiguous()  # [in]
        w = dense * smooth
        amax = w.abs().amax(dim=1).clamp_min(_TINY)
        self.scale = (amax / _QMAX).contiguous()  # [out]
        self.q = (torch.round(w / self.scale[:, None]).clamp_(-_QMAX, _QMAX)
                  .to(torch.int8).t().contiguous())  # [in, out]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] float32 -> [T, out] float32."""
        xq, xscale = quantize_rows(x * self.inv_smooth)
        return (torch._int_mm(xq, self.q) * xscale).mul_(self.scale)


def int8_gemm_pays() -> bool:
    """Whether PyTorch's int8 GEMM beats its float32 one here, at the smallest row count the
    int8 path takes (INT8_FROM_ROWS by 256 by 256, the best of three after one untimed
    call each). Where it runs oneDNN it is the faster by a factor; where it runs PyTorch's
    plain loop, slower by 20-50x: no noise decides between the two."""
    a = torch.ones(INT8_FROM_ROWS, 256, dtype=torch.int8)
    b = torch.ones(256, 256, dtype=torch.int8)
    af, bf = a.float(), b.float()

    def best(fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    return best(lambda: torch._int_mm(a, b)) < best(lambda: af @ bf)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [T, in], float32 [T, 1]): each row rounded to 8 bits with its own scale."""
    amax = x.abs().amax(dim=1, keepdim=True).clamp_min_(_TINY)
    scale = amax.div_(_QMAX)
    return x.div_(scale).round_().clamp_(-_QMAX, _QMAX).to(torch.int8), scale


class Int8Capable(Protocol):
    """A projection that can carry an int8 copy of its weight (linear.Proj, quant.QuantProj):
    it takes that path from INT8_FROM_ROWS rows once `int8` is set."""

    int8: Any

    def dense_weight(self) -> torch.Tensor:
        """Its weight [out, in] in float32, the exact values it multiplies by."""
        ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class _Layer(Protocol):
    @property
    def qkv(self) -> Int8Capable: ...
    @property
    def o(self) -> Int8Capable: ...
    @property
    def gate_up(self) -> Int8Capable: ...


def int8_projections(layers: Sequence[_Layer]) -> list[Int8Capable]:
    """The projections that take the int8 path: q/k/v, o and gate/up of every layer. The
    down projection keeps its exact path: its input (SiLU(gate) * up) has outliers that
    smoothing does not tame, and it alone moved the next-token distributions more than the
    other three together (KL over 600 tokens of the report's text, SmolLM2: 0.0185 nats
    for down alone, 0.0109 for the three, 0.0267 for all four)."""
    return [p for ly in layers for p in (ly.qkv, ly.o, ly.gate_up)]


class _Recorder:
    """Stands in for the int8 path during calibration: notes each input channel's largest
    magnitude and multiplies exactly."""

    def __init__(self, dense: torch.Tensor) -> None:
        self.weight_t = dense.t()
        self.act_max = torch.zeros(dense.shape[1])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        torch.maximum(self.act_max, x.abs().amax(dim=0), out=self.act_max)
        return x @ self.weight_t


def attach(model: Model, projections: Sequence[Int8Capable], ids: Sequence[int]) -> int:
    """Give each projection an int8 copy of its weight, smoothed by the activations the
    model makes over the calibration tokens `ids` (one prefill of them, in a cache of its
    own that is dropped afterwards); the bytes this adds."""
    if len(ids) < INT8_FROM_ROWS:
        raise ValueError(f"calibration needs at least {INT8_FROM_ROWS} tokens, got {len(ids)}")
    recorders = [_Recorder(p.dense_weight()) for p in projections]
    for p, r in zip(projections, recorders, strict=True):
        p.int8 = r
    block = 16
    blocks = list(range((len(ids) + block - 1) // block))
    model.init_kv_cache(len(blocks), block)
    n = len(ids)
    with torch.inference_mode():
        model.forward(ForwardBatch(
            input_ids=list(ids), positions=list(range(n)), slot_mapping=list(range(n)),
            query_lens=[n], context_lens=[n], block_tables=[blocks], logits_indices=[n - 1]))
    model.kv_cache = None  # type: ignore[attr-defined]  # the engine makes its own
    added = 0
    for p, r in zip(projections, recorders, strict=True):
        p.int8 = w = Int8Weight(p.dense_weight(), r.act_max)
        added += w.q.nbytes + w.scale.nbytes + w.inv_smooth.nbytes
    return added


# Calibration text: ordinary English prose and a little code, written for this purpose (not
# the text the KL report measures on). Its activations set each channel's smoothing.
CALIBRATION_TEXT = """\
The library opens at nine, and by ten the reading room is full: students with laptops,
a retired engineer working through a history of bridges, two children choosing picture
books with great seriousness. The librarian knows most of them by name. She answers
questions about train times, tax forms and the spelling of difficult words, and when she
does not know, she says so and finds out. In the afternoon a school class arrives to learn
how to search the catalogue; the teacher asks them to find a book about volcanoes, and
within a minute three of them are arguing about whether Vesuvius or Krakatoa was worse.
def mean(values: list[float]) -> float:
    \"\"\"The arithmetic mean of a non-empty list.\"\"\"
    if not values:
        raise ValueError("mean of an empty list")
    return sum(values) / len(values)

Question: What is 17 times 23? Answer: 17 times 23 is 391, because 17 times 20 is 340 and
17 times 3 is 51. Numbers, dates (4 July 1776, 2026-12-04) and prices ($19.99, 5 EUR) are
part of ordinary text too, as are lists: apples, pears, plums; red, green, blue.
"""
