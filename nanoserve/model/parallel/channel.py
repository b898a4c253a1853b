"""Rank 0's commands to the other ranks: integers in shared memory, woken by a semaphore.

A step's batch is a few hundred integers (1,667 for a decode step of 64 sequences of 300
tokens). Handing it to two other ranks and seeing both take it: 305 us median through shared
memory and a semaphore, against 2,367 us through gloo's `broadcast_object_list` and a
barrier (which pickles, and sends the size and the bytes as two collectives), 7.8x, in one
run of scripts/bench_tp_channel.py on 2 shared cores. The model's own collectives then keep
the ranks in step.

Layout of the shared int64 buffer: [seq, command, n, payload[0:n]]. Each worker, woken,
copies the payload out and writes `seq` to its slot of `acks`; rank 0 waits for every ack of
the previous command before it overwrites the buffer. A payload larger than the buffer
comes with a new, larger buffer, handed over through a queue first.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from nanoserve.model.base import ModelLost

FORWARD, COPY, INIT_KV, DIGEST, EXIT, RESIZE = range(6)
_HEADER = 3


class RankDied(ModelLost):
    """A tensor-parallel rank is gone; the model cannot run another step."""


class Channel:
    """Built by rank 0 and handed to each worker process at spawn (it pickles)."""

    def __init__(self, ctx: Any, world_size: int, capacity: int = 1 << 16) -> None:
        self.world_size = world_size
        self.buf = torch.zeros(_HEADER + capacity, dtype=torch.int64).share_memory_()
        # -1: loading; then the seq of the last command taken (0 once ready)
        self.acks = torch.full((world_size,), -1, dtype=torch.int64).share_memory_()
        # Semaphores, not events: a multiprocessing Event's set() waits for every sleeper to
        # wake, and a worker killed while it slept never does (rank 0 hung there).
        self.wake = [ctx.Semaphore(0) for _ in range(world_size)]
        self.buffers = [ctx.Queue() for _ in range(world_size)]
        self.seq = 0

    # ---- rank 0 -----------------------------------------------------------------------

    def send(self, command: int, payload: Sequence[int], alive: Callable[[], None]) -> None:
        """Post a command to every worker. `alive` raises RankDied for a dead rank; it is
        checked while waiting for the previous command's acks."""
        self.wait_acks(self.seq, alive)
        if _HEADER + len(payload) > self.buf.numel():
            bigger = torch.zeros(_HEADER + 2 * len(payload), dtype=torch.int64).share_memory_()
            for rank in range(1, self.world_size):
                self.buffers[rank].put(bigger)
            self.post(RESIZE, [])
            self.wait_acks(self.seq, alive)
            self.buf = bigger
        self.post(command, payload)

    def post(self, command: int, payload: Sequence[int]) -> None:
        self.seq += 1
        n = len(payload)
        if n:
            self.buf[_HEADER:_HEADER + n] = torch.tensor(payload, dtype=torch.int64)
        self.buf[:_HEADER] = torch.tensor([self.seq, command, n], dtype=torch.int64)
        for rank in range(1, self.world_size):
            self.wake[rank].release()

    def wait_acks(self, seq: int, alive: Callable[[], None], timeout_s: float | None = None
                  ) -> None:
        """Until every worker has taken command `seq` (0: finished loading)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while int(self.acks[1:].min()) < seq:
            alive()
            if deadline is not None and time.monotonic() > deadline:
                raise RankDied(f"a tensor-parallel rank did not answer within {timeout_s} s")
            time.sleep(50e-6)

    # ---- ranks 1..N-1 -------------------------------------------------------------------

    def receive(self, rank: int, parent_pid: int) -> tuple[int, list[int]]:
        """The next command and its payload; EXIT when the serving process is gone."""
        while not self.wake[rank].acquire(timeout=1.0):
            if os.getppid() != parent_pid:  # rank 0 died without a word: do not linger
                return EXIT, []
        seq, command, n = (int(v) for v in self.buf[:_HEADER])
        payload = self.buf[_HEADER:_HEADER + n].tolist() if n else []
        if command == RESIZE:
            self.buf = self.buffers[rank].get()
        self.acks[rank] = seq
        return command, payload

    def ready(self, rank: int) -> None:
        self.acks[rank] = 0
