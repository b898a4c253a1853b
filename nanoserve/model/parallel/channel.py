"""Rank 0's commands to the other ranks: integers in shared memory, and one byte down each
worker's stdin to wake it.

A step's batch is a few hundred integers (1,667 for a decode step of 64 sequences of 300
tokens). Handing it to two other ranks and seeing both take it through shared memory costs
a few hundred microseconds, against 2,367 us through gloo's `broadcast_object_list` and a
barrier (which pickles, and sends the size and the bytes as two collectives):
scripts/bench_tp_channel.py. The model's own collectives then keep the ranks in step.

Why files and a pipe, not multiprocessing's semaphores and queues: the workers are fresh
interpreters started by subprocess (parallel/launch.py), to which nothing can be handed at
start but a pipe and names. The pipe does double duty: its end-of-file tells a worker that
rank 0 is gone, however it died.

Two shared blocks, each a file in /dev/shm that every rank maps and rank 0 unlinks once
they all have it (so nothing is left behind even if rank 0 is killed later):
- control: [acks[W], beats[W], stages[W]], W = world size. A worker writes its own slots
  only: the seq of the last command it took (-1 while it starts), a counter its heartbeat
  thread bumps, and how far its start-up has got (STAGES).
- buffer: [seq, command, n, payload[0:n]]. Rank 0 writes the payload, then the header, then
  one byte to each worker; a worker reads the header only after its read of that byte
  returns (the system call orders the memory), copies the payload out and acks the seq.
  Rank 0 waits for every ack of the previous command before it overwrites the buffer. A
  payload larger than the buffer comes after a RESIZE to a new, larger one, the file
  named `<buffer>.<k>` for the k-th resize (its payload: [k]).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from nanoserve.model.base import ModelLost

FORWARD, COPY, INIT_KV, DIGEST, EXIT, RESIZE = range(6)
STARTING, LOADING, JOINING, READY = range(4)
# What a rank at each stage is doing (or waiting for): the start-up's log and its error.
STAGES = ("starting (its Python interpreter and torch still importing)",
          "loading its shard of the weights",
          "waiting in the process group's rendezvous for the other ranks",
          "ready")
_HEADER = 3
_SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None  # else the temp folder


class RankDied(ModelLost):
    """A tensor-parallel rank is gone; the model cannot run another step."""


@dataclass(frozen=True, slots=True)
class ChannelFiles:
    """What a worker needs to map the channel (it pickles into the worker's boot)."""

    world_size: int
    control: str
    buffer: str


def _create(nbytes: int, path: str | None = None) -> tuple[str, mmap.mmap]:
    if path is None:
        fd, path = tempfile.mkstemp(prefix="nanoserve-tp-", dir=_SHM)
    else:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        return path, mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)  # the mapping keeps the memory


def _open(path: str) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, 0)
    finally:
        os.close(fd)


def _ints(m: mmap.mmap) -> torch.Tensor:
    return torch.frombuffer(m, dtype=torch.int64)  # shares the mapping (and keeps it alive)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class _Control:
    """The control block's three arrays, as plain memoryviews: the heartbeat thread and the
    watch touch them without a torch call."""

    def __init__(self, m: mmap.mmap, world_size: int) -> None:
        view = memoryview(m).cast("q")
        w = world_size
        self.acks, self.beats, self.stages = view[:w], view[w:2 * w], view[2 * w:3 * w]


class Channel:
    """Rank 0's end. `connect(rank, fd)` gives it each worker's wake pipe once started."""

    def __init__(self, world_size: int, capacity: int = 1 << 16) -> None:
        self.world_size = world_size
        control_path, control = _create(3 * world_size * 8)
        buffer_path, buffer = _create((_HEADER + capacity) * 8)
        self.files = ChannelFiles(world_size, control_path, buffer_path)
        self._paths = [control_path, buffer_path]  # unlinked once every worker has them
        self.control = _Control(control, world_size)
        for rank in range(world_size):
            self.control.acks[rank] = -1
        self.buf = _ints(buffer)
        self.wakes: dict[int, int] = {}
        self.seq = 0
        self.resizes = 0

    def connect(self, rank: int, wake_fd: int) -> None:
        # Non-blocking: a stopped worker must never stall rank 0. A full pipe already holds
        # more wake-ups than that worker needs.
        os.set_blocking(wake_fd, False)
        self.wakes[rank] = wake_fd

    def unlink(self) -> None:
        """Remove the files: every worker has mapped them (or is gone)."""
        for path in self._paths:
            _unlink(path)
        self._paths.clear()

    def send(self, command: int, payload: Sequence[int], alive: Callable[[], None]) -> None:
        """Post a command to every worker. `alive` raises RankDied for a dead rank; it is
        checked while waiting for the previous command's acks."""
        self.wait_acks(self.seq, alive)
        if _HEADER + len(payload) > self.buf.numel():
            self.resizes += 1
            path, bigger = _create((_HEADER + 2 * len(payload)) * 8,
                                   f"{self.files.buffer}.{self.resizes}")
            try:
                self.post(RESIZE, [self.resizes])
                self.wait_acks(self.seq, alive)
            finally:
                _unlink(path)
            self.buf = _ints(bigger)
        self.post(command, payload)

    def post(self, command: int, payload: Sequence[int]) -> None:
        self.seq += 1
        n = len(payload)
        if n:
            self.buf[_HEADER:_HEADER + n] = torch.tensor(payload, dtype=torch.int64)
        self.buf[:_HEADER] = torch.tensor([self.seq, command, n], dtype=torch.int64)
        for fd in self.wakes.values():
            # A full pipe wakes its worker anyway; a closed one: the watch sees the exit.
            with contextlib.suppress(BlockingIOError, BrokenPipeError):
                os.write(fd, b"\0")

    def wait_acks(self, seq: int, alive: Callable[[], None], timeout_s: float | None = None
                  ) -> None:
        """Until every worker has taken command `seq`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while min(self.control.acks[1:]) < seq:
            alive()
            if deadline is not None and time.monotonic() > deadline:
                raise RankDied(f"a tensor-parallel rank did not answer within {timeout_s} s")
            time.sleep(50e-6)


class WorkerChannel:
    """A worker's end: rank `rank`, woken through `wake_fd` (its stdin)."""

    def __init__(self, files: ChannelFiles, rank: int, wake_fd: int) -> None:
        self.rank = rank
        self.wake_fd = wake_fd
        self.files = files
        self.control = _Control(_open(files.control), files.world_size)
        self.buf = _ints(_open(files.buffer))
        self.taken = 0

    def receive(self) -> tuple[int, list[int]]:
        """The next command and its payload; EXIT when the serving process is gone."""
        while True:
            if not os.read(self.wake_fd, 4096):  # end of file: rank 0 has exited
                return EXIT, []
            seq = int(self.buf[0])
            if seq > self.taken:  # else a spare wake-up, read with an earlier command's
                break
        command, n = int(self.buf[1]), int(self.buf[2])
        payload = self.buf[_HEADER:_HEADER + n].tolist() if n else []
        if command == RESIZE:
            self.buf = _ints(_open(f"{self.files.buffer}.{payload[0]}"))
        self.taken = seq
        self.control.acks[self.rank] = seq
        return command, payload

    def stage(self, stage: int) -> None:
        self.control.stages[self.rank] = stage
        if stage == READY:
            self.control.acks[self.rank] = 0

    def beat(self) -> None:
        self.control.beats[self.rank] += 1
