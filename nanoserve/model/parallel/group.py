"""Rank 0's model: its own shard, plus N-1 spawned processes that hold the others.

The engine sees one `Model`. Rank 0 is the serving process and keeps everything that is not
weights (scheduler, block pool, tokenizer, sampler: only rank 0 samples, so batch invariance
and replay are the single-process engine's); each step it posts the batch's integers to the
workers (parallel/channel.py) and runs its own shard, and the all-reduces inside the layers
keep the ranks in step. Rank 0's logits are the model's.

A rank that dies fails the step that needed it: its peers' collective raises (gloo: the
connection closes) or the wait for its ack sees the exit; a rank that hangs fails it when the
process group's timeout expires. Either way `forward` raises RankDied, the engine dies on its
usual path (streams end with an error frame, /health answers 503), and the remaining ranks
are stopped. Workers are daemonic and watch their parent, so none outlives the server.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from nanoserve.model.base import ForwardBatch
from nanoserve.model.parallel.channel import COPY, DIGEST, EXIT, FORWARD, INIT_KV, Channel, RankDied
from nanoserve.model.parallel.worker import (
    GroupSpec,
    LoadSpec,
    all_digests,
    build_shard,
    encode_batch,
    worker_main,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
BACKENDS = ("auto", "gloo", "nccl")
# Seconds a collective may wait for a silent rank before the step fails (a hung rank).
DEFAULT_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def pick_backend(backend: str, device: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"distributed_backend must be one of {', '.join(BACKENDS)}, "
                         f"got {backend!r}")
    if backend == "auto":
        return "nccl" if torch.device(device).type == "cuda" else "gloo"
    return backend


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class TensorParallelModel:
    """`nanoserve.model.Model` over N ranks (module docstring)."""

    def __init__(self, spec: LoadSpec, world_size: int, *, backend: str = "auto",
                 exact: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        from nanoserve.model.loader import peek_config
        from nanoserve.model.parallel.shard import check_tp_size

        self.config = peek_config(spec.name)  # the whole model's shape; each rank's is less
        check_tp_size(self.config, world_size)
        self.group = GroupSpec(world_size, pick_backend(backend, spec.device), free_port(),
                               max(cpu_count() // world_size, 1), exact, timeout_s)
        ctx = torch.multiprocessing.get_context("spawn")
        self.channel = Channel(ctx, world_size)
        self.procs: list[Any] = []
        self._failed: str | None = None
        self._closing = threading.Event()  # set before any EXIT: the watch then stays quiet
        self._lost: str | None = None  # the ranks that had exited when the watch woke
        for rank in range(1, world_size):
            p = ctx.Process(target=worker_main, name=f"nanoserve-tp-rank{rank}", daemon=True,
                            args=(spec, self.group, rank, self.channel, os.getpid()))
            p.start()
            self.procs.append(p)
        log.info("tensor parallel: %d ranks over %s, %d threads each; rank pids %s",
                 world_size, self.group.backend, self.group.threads,
                 " ".join(str(p.pid) for p in self.procs))
        self._finalizer = weakref.finalize(self, _stop, self.channel, list(self.procs),
                                           self._closing)
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(self.group.threads)  # here: a thread count is per thread
        try:
            self.model = self._while_alive(lambda: build_shard(spec, self.group, 0))
            self.channel.wait_acks(0, self._check_alive, timeout_s)
        except BaseException as exc:
            self._failed = f"tensor parallel group failed to start: {exc}"  # no group to leave
            self.close()
            raise
        self.device = self.model.device
        self.world_size = world_size
        self._last = torch.empty(0)
        threading.Thread(target=self._watch, name="nanoserve-tp-watch", daemon=True).start()

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids (ranks 1..N-1)."""
        return [p.pid for p in self.procs]

    def weight_bytes(self) -> int:
        """Bytes of weights one rank reads per decode step (the ranks read theirs at once)."""
        return self.model.weight_bytes()

    # ---- the Model protocol -------------------------------------------------------------

    def kv_bytes_per_block(self, block_size: int) -> int:
        """One rank's bytes (its KV heads): the pool is sized per rank."""
        return self.model.kv_bytes_per_block(block_size)

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self._run(INIT_KV, [num_blocks, block_size],
                  lambda: self.model.init_kv_cache(num_blocks, block_size))

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        if pairs:
            self._run(COPY, [v for pair in pairs for v in pair],
                      lambda: self.model.copy_blocks(pairs))

    def pick_greedy(self, batch: ForwardBatch) -> None:
        return None

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self._last = self._run(FORWARD, encode_batch(batch), lambda: self.model.hidden(batch))
        with torch.no_grad():
            return self.model.lm_head(self._last).float()

    # ---- checks and lifetime --------------------------------------------------------------

    def digests(self) -> list[int]:
        """Each rank's digest of its last step's final hidden states, in rank order: equal
        when the ranks hold the same bits, as the reduction promises."""
        return self._run(DIGEST, [], lambda: all_digests(self._last, self.world_size))

    def close(self) -> None:
        """Stop the workers (EXIT, then SIGTERM, then SIGKILL) and leave the group."""
        import torch.distributed as dist

        self._finalizer()
        torch.set_num_threads(self._threads_before)
        if dist.is_initialized() and self._failed is None:
            dist.destroy_process_group()  # (a failed group's may block: the exit ends it)

    def _run(self, command: int, payload: list[int], local: Callable[[], T]) -> T:
        if self._failed is not None:
            raise RankDied(self._failed)
        try:
            self.channel.send(command, payload, self._check_alive)
            return local()
        except Exception as exc:
            self._fail(exc)
            raise RankDied(self._failed or str(exc)) from exc

    def _while_alive(self, fn: Callable[[], T]) -> T:
        """fn() in a thread while watching the workers: a rank that dies while the group
        forms would otherwise leave rank 0 waiting for the whole timeout."""
        box: list[Any] = []

        def target() -> None:
            try:
                box.append((True, fn()))
            except BaseException as exc:  # handed to the caller below
                box.append((False, exc))

        t = threading.Thread(target=target, daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.05)
            self._check_alive()
        ok, value = box[0]
        if not ok:
            raise value
        result: T = value
        return result

    def _watch(self) -> None:
        """When one worker exits unasked, kill the others: a survivor may sit in a collective
        that waits for the dead rank (gloo reports a closed connection only to the ranks
        that talk to it), and rank 0's own collective then fails at once, not at the
        process group's timeout."""
        from multiprocessing.connection import wait

        ready = wait([p.sentinel for p in self.procs])
        if self._closing.is_set():
            return
        for p in self.procs:
            if p.sentinel in ready:
                p.join(1.0)  # its pipe closes a moment before its exit status is there
        self._lost = self._dead_ranks()
        log.error("tensor parallel: %s; stopping the other ranks", self._lost)
        for p in self.procs:
            if p.exitcode is None:
                p.kill()

    def _dead_ranks(self) -> str:
        return "; ".join(f"rank {r} (pid {p.pid}) exited with code {p.exitcode}"
                         for r, p in enumerate(self.procs, start=1) if p.exitcode is not None)

    def _check_alive(self) -> None:
        for rank, p in enumerate(self.procs, start=1):
            if p.exitcode is not None:
                raise RankDied(f"tensor-parallel rank {rank} (pid {p.pid}) exited with "
                               f"code {p.exitcode}")

    def _fail(self, exc: BaseException) -> None:
        # A peer's broken connection can reach rank 0 before the OS has reported its exit:
        # wait a moment for it, so that the error names the rank that died.
        deadline = time.monotonic() + 1.0
        while self._lost is None and time.monotonic() < deadline:
            time.sleep(0.01)
        self._failed = f"tensor parallel group failed: {self._lost or exc}"
        log.error("%s", self._failed)
        if self._finalizer.detach() is not None:  # the survivors are stuck: no long grace
            _stop(self.channel, self.procs, self._closing, grace_s=1.0)


def _stop(channel: Channel, procs: list[Any], closing: threading.Event,
          grace_s: float = 5.0) -> None:
    """Every worker ended: asked first, then terminated, then killed."""
    closing.set()
    if any(p.exitcode is None for p in procs):
        channel.post(EXIT, [])  # without waiting for acks: a stuck rank never gives one
    for p in procs:
        p.join(grace_s)
        if p.exitcode is None:
            p.terminate()
            p.join(grace_s)
        if p.exitcode is None:
            p.kill()
            p.join()
