"""Rank 0's model: its own shard, plus N-1 worker processes that hold the others.

The engine sees one `Model`. Rank 0 is the serving process and keeps everything that is not
weights (scheduler, block pool, tokenizer, sampler: only rank 0 samples, so batch invariance
and replay are the single-process engine's); each step it posts the batch's integers to the
workers (parallel/channel.py) and runs its own shard, and the all-reduces inside the layers
keep the ranks in step. Rank 0's logits are the model's.

Start-up: the workers are fresh interpreters (parallel/launch.py); each imports torch, loads
its shard and joins the process group, marking each stage in the channel, and rank 0 waits
for all of them (parallel/startup.py) for up to `timeout_s` (the rendezvous's and the
collectives' timeout too), logging who is at which stage every 10 s. On a busy 2-core host
three ranks importing torch at once take far longer than on an idle one, so the default is
generous (600 s, vLLM's wait for its engine); a rank that exits fails the start at once. A
start that fails is one ModelStartError naming each rank that was not ready and what it was
doing, every worker killed and reaped.

Running: a rank that dies or goes silent (no heartbeat for `heartbeat_timeout_s`) is seen
by the watch (parallel/watch.py), which kills every worker, so the step that needed it fails
at once: `forward` raises RankDied, the engine dies on its usual path (streams end with an
error frame, /health answers 503), and `on_lost` listeners hear of it even when no step
runs. Workers watch their parent, so none outlives the server.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from nanoserve.model.base import ForwardBatch
from nanoserve.model.cpu import cpu_count
from nanoserve.model.parallel.channel import (
    COPY,
    DIGEST,
    EXIT,
    FORWARD,
    INIT_KV,
    Channel,
    RankDied,
)
from nanoserve.model.parallel.launch import Rank
from nanoserve.model.parallel.startup import start_rank0
from nanoserve.model.parallel.watch import Watch
from nanoserve.model.parallel.worker import (
    Boot,
    GroupSpec,
    LoadSpec,
    all_digests,
    encode_batch,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
BACKENDS = ("auto", "gloo", "nccl")
# Seconds the start may take (every rank loaded and joined), and the process group's
# timeout for the rendezvous and for a collective.
DEFAULT_TIMEOUT_S = 600.0
# Seconds a rank's heartbeat may stand still before the rank is taken as lost.
DEFAULT_HEARTBEAT_TIMEOUT_S = 5.0


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


def _seconds(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
    return float(value)


class TensorParallelModel:
    """`nanoserve.model.Model` over N ranks (module docstring)."""

    def __init__(self, spec: LoadSpec, world_size: int, *, backend: str = "auto",
                 exact: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S,
                 heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S) -> None:
        from nanoserve.model.loader import peek_config
        from nanoserve.model.parallel.shard import check_tp_size

        timeout_s = _seconds("distributed_timeout", timeout_s)
        heartbeat_timeout_s = _seconds("distributed_heartbeat_timeout", heartbeat_timeout_s)
        self.config = peek_config(spec.name)  # the whole model's shape; each rank's is less
        check_tp_size(self.config, world_size)
        self.group = GroupSpec(world_size, pick_backend(backend, spec.device), free_port(),
                               max(cpu_count() // world_size, 1), exact, timeout_s)
        self.channel = Channel(world_size)
        self.procs: list[Rank] = []
        self._failed: str | None = None
        self._watch = Watch(self.channel.control.beats, heartbeat_timeout_s)
        self._finalizer = weakref.finalize(self, _stop, self.channel, self.procs, self._watch)
        self._threads_before = torch.get_num_threads()
        started = time.time()
        try:
            for rank in range(1, world_size):
                boot = Boot(spec, self.group, rank, self.channel.files, os.getpid(),
                            logging.getLogger().getEffectiveLevel(),
                            min(0.5, heartbeat_timeout_s / 5), started)
                self.procs.append(Rank(boot))
                self.channel.connect(rank, self.procs[-1].wake_fd)
            log.info("tensor parallel: %d ranks over %s, %d threads each; rank pids %s",
                     world_size, self.group.backend, self.group.threads,
                     " ".join(str(p.pid) for p in self.procs))
            torch.set_num_threads(self.group.threads)  # here: a thread count is per thread
            self.model = start_rank0(spec, self.group, self.channel, self.procs, timeout_s)
        except BaseException as exc:
            self._failed = f"tensor parallel group failed to start: {exc}"  # no group to leave
            self.close(grace_s=0.0)
            raise
        finally:
            self.channel.unlink()  # every rank has mapped the files, or is gone
        self.device = self.model.device
        self.world_size = world_size
        self._last = torch.empty(0)
        self._watch.ranks = list(self.procs)
        self._watch.start()

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

    def on_lost(self, fn: Callable[[str], None]) -> None:
        """Call fn(reason), once, from the watch's thread, when a rank dies or goes silent
        (at once, here, if one already has): the model can run no further step."""
        self._watch.on_lost(lambda reason: fn(f"tensor parallel group failed: {reason}"))

    # ---- checks and lifetime --------------------------------------------------------------

    def digests(self) -> list[int]:
        """Each rank's digest of its last step's final hidden states, in rank order: equal
        when the ranks hold the same bits, as the reduction promises."""
        return self._run(DIGEST, [], lambda: all_digests(self._last, self.world_size))

    def close(self, grace_s: float = 2.0) -> None:
        """Stop the workers (EXIT; whatever has not left after `grace_s` is killed) and
        leave the group."""
        import torch.distributed as dist

        if self._finalizer.detach() is not None:
            _stop(self.channel, self.procs, self._watch, grace_s)
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

    def _check_alive(self) -> None:
        if self._watch.lost is not None:
            raise RankDied(f"tensor parallel group failed: {self._watch.lost}")
        for p in self.procs:
            if p.exitcode is not None:
                raise RankDied(f"tensor-parallel rank {p.rank} (pid {p.pid}) exited with "
                               f"code {p.exitcode}")

    def _fail(self, exc: BaseException) -> None:
        # A peer's broken connection can reach rank 0 before the watch has seen the exit (or
        # the silence that made it kill the ranks): wait a moment for it, so that the error
        # names the rank that was lost.
        deadline = time.monotonic() + 1.0
        while self._watch.lost is None and time.monotonic() < deadline:
            time.sleep(0.01)
        self._failed = f"tensor parallel group failed: {self._watch.lost or exc}"
        log.error("%s", self._failed)
        if self._finalizer.detach() is not None:  # the survivors are stuck: no grace
            _stop(self.channel, self.procs, self._watch, grace_s=0.0)


def _stop(channel: Channel, procs: list[Rank], watch: Watch, grace_s: float = 2.0) -> None:
    """Every worker ended: asked to leave, and killed if it has not within `grace_s` (a
    stopped rank never reads the request, and SIGTERM would wait for its SIGCONT)."""
    watch.stop()
    deadline = time.monotonic() + grace_s
    if grace_s > 0 and all(p.exitcode is None for p in procs):
        try:  # a worker still reading the last command must not see it half overwritten
            channel.wait_acks(channel.seq, lambda: None, grace_s)
            channel.post(EXIT, [])
        except RankDied:
            pass  # a rank that takes no command will be killed below
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0.0))
    for p in procs:
        p.kill()
        p.join()
        p.close_pipe()
    channel.unlink()
