"""The yardsticks `nanoserve bench` measures its figures against, in the same process: the
compute peak of a float32 `torch.mm`, the speed of reading a buffer (what batch-1 decode
does to its weights) and of copying one, and the weights a token multiplies by."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from nanoserve.model import Model
from nanoserve.model.native import Kernels


def _fastest(fn: Callable[[], object], times: int) -> float:
    """The fastest of `times` timed calls of `fn`, in seconds."""
    best = float("inf")
    for _ in range(times):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _best_of(fn: Callable[[], object], times: int) -> float:
    fn()  # warm-up: first-touch page faults and kernel selection
    return _fastest(fn, times)


def mm_flops(n: int = 2048) -> float:
    """FLOP/s of one n x n float32 matmul: the compute yardstick."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / _best_of(lambda: torch.mm(a, b), 5)


def copy_bandwidth(nbytes: int = 256 << 20) -> float:
    """Bytes/s moved (read plus write) by copying a tensor far larger than any cache."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_of(lambda: dst.copy_(src), 5)


def read_bandwidth(nbytes: int, kernels: Kernels | None = None) -> float:
    """Bytes/s read, with no writes, from a buffer of `nbytes`: what batch-1 decode does to
    its weights. Read by the kernels' own threads, each a contiguous run of bytes
    (csrc/quant.cpp's stream_read); by torch's sum where there are no kernels."""
    return reader(nbytes, kernels)(5)


def reader(nbytes: int, kernels: Kernels | None = None) -> Callable[[int], float]:
    """read_bandwidth's buffer, made and read once untimed (its pages' first touch): the
    returned function reads it `times` times and gives the best bytes/s, as often as asked.
    The warm-up is once, not a call: paired_shares reads once before every decode step."""
    buf = torch.ones(max(nbytes, 1 << 20) // 64 * 64, dtype=torch.uint8)
    floats = buf.view(torch.float32)
    read: Callable[[], object] = ((lambda: kernels.ops.stream_read(buf)) if kernels is not None
                                  else floats.sum)
    read()
    return lambda times: buf.numel() / _fastest(read, times)


def weight_numel(model: Model) -> int:
    """Weights a token multiplies by: every layer's projections and the LM head (the
    embedding is a row look-up). 2 FLOP and one read of each per token."""
    c = model.config
    attn = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    attn += c.num_heads * c.head_dim * c.hidden_size
    mlp = 3 * c.hidden_size * c.intermediate_size
    return c.num_layers * (attn + mlp) + c.vocab_size * c.hidden_size
