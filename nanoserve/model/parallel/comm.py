"""The one collective tensor parallelism needs: the sum over the ranks of a row-parallel
projection's partial output, which every rank then holds whole.

Two ways to sum:
- `all_reduce` (the default, as vLLM): torch.distributed's all-reduce, in place. Every rank
  ends with the same bits, but the order of the additions is the backend's (gloo's ring
  splits the tensor into chunks and adds each in a different rank order).
- exact: all-gather the N parts and add them in rank order, ((p0 + p1) + p2) + ..., on every
  rank. The result is then a function of the parts alone, so a process group and the
  in-process emulation (`ThreadGroup`, parallel/emulate.py) give the same bits.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch


def sum_in_rank_order(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    out = parts[0].clone()
    for p in parts[1:]:
        out.add_(p)
    return out


class ProcessGroupSum:
    """The sum over the default torch.distributed process group."""

    def __init__(self, world_size: int, *, exact: bool) -> None:
        self.world_size = world_size
        self.exact = exact

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        t = t.contiguous()
        if not self.exact:
            dist.all_reduce(t)
            return t
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t)
        return sum_in_rank_order(parts)


class ThreadGroup:
    """N ranks as N threads of one process: an all-gather through a shared list and a
    barrier, summed in rank order as the exact mode does. `member(rank)` is that rank's sum
    function. A barrier broken by one rank's failure fails the others instead of hanging."""

    def __init__(self, world_size: int, timeout_s: float = 60.0) -> None:
        self.world_size = world_size
        self._parts: list[torch.Tensor | None] = [None] * world_size
        self._barrier = threading.Barrier(world_size, timeout=timeout_s)

    def member(self, rank: int) -> _Member:
        return _Member(self, rank)

    def abort(self) -> None:
        self._barrier.abort()


class _Member:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group = group
        self.rank = rank

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        g = self.group
        g._parts[self.rank] = t.contiguous()
        g._barrier.wait()  # every part written
        out = sum_in_rank_order([p for p in g._parts if p is not None])
        g._barrier.wait()  # every part read: the next call may overwrite them
        return out
