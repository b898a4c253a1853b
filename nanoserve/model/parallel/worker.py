"""Ranks 1..N-1: each loads its shard, joins the process group, and runs what rank 0 posts
(parallel/channel.py) until told to exit or rank 0 is gone.

`main` is the process's entry point (`python -m nanoserve.model.parallel`, parallel/launch.py
says why not multiprocessing). It marks each stage of the start in the channel's control
block, which rank 0 watches and names when a start-up fails, and runs a heartbeat thread
for as long as the process lives: a counter bumped every `beat_s` seconds, from a thread so
that it beats while the main thread computes or waits in a collective. A rank that is
stopped (SIGSTOP), or otherwise gets no CPU, stops beating, and rank 0 sees it within its
heartbeat timeout instead of at the process group's. The same thread ends the worker when
its parent is gone (the pipe's end-of-file says so too, but only when the worker reads it).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import signal
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch

from nanoserve.model.base import ForwardBatch
from nanoserve.model.llama import LlamaModel
from nanoserve.model.parallel.channel import (
    COPY,
    DIGEST,
    EXIT,
    FORWARD,
    INIT_KV,
    JOINING,
    LOADING,
    READY,
    RESIZE,
    ChannelFiles,
    WorkerChannel,
)
from nanoserve.model.parallel.comm import ProcessGroupSum
from nanoserve.model.parallel.shard import shard_weights
from nanoserve.model.weights import llama_weights, torch_dtype

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """What every rank loads: `nanoserve.model.load`'s arguments."""

    name: str
    device: str = "cpu"
    dtype: str = "float32"
    quantization: str = "auto"


@dataclass(frozen=True, slots=True)
class GroupSpec:
    world_size: int
    backend: str  # gloo | nccl
    port: int
    threads: int  # torch threads per rank on the CPU
    exact: bool
    timeout_s: float  # the rendezvous's and every collective's


@dataclass(frozen=True, slots=True)
class Boot:
    """Everything a worker is told at start (parallel/launch.py sends it)."""

    spec: LoadSpec
    group: GroupSpec
    rank: int
    channel: ChannelFiles
    parent_pid: int
    log_level: int
    beat_s: float  # seconds between the worker's heartbeats
    started_at: float  # rank 0's time.time() at the launch, for the worker's log


_LENGTH = struct.Struct("<Q")


def encode_boot(boot: Boot) -> bytes:
    data = pickle.dumps(boot)
    return _LENGTH.pack(len(data)) + data


def read_boot(fd: int) -> Boot:
    """A worker's Boot from its stdin (the pipe then stays open for wake-ups)."""

    def read_exactly(n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = os.read(fd, n - len(out))
            if not chunk:
                raise EOFError("rank 0 closed the pipe before the boot record arrived")
            out += chunk
        return out

    (n,) = _LENGTH.unpack(read_exactly(_LENGTH.size))
    boot = pickle.loads(read_exactly(n))
    if not isinstance(boot, Boot):
        raise TypeError(f"expected a Boot on stdin, got {type(boot).__name__}")
    return boot


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: cuda:r on CUDA (one GPU a rank), the CPU as it is."""
    return f"cuda:{rank}" if torch.device(device).type == "cuda" else device


def build_shard(spec: LoadSpec, group: GroupSpec, rank: int,
                stage: Callable[[int], None]) -> LlamaModel:
    """Build this rank's shard, then join the process group (every rank, rank 0 included),
    telling `stage` as it goes. Loading first: the rendezvous then waits only for the
    slowest rank's load to end, not for every rank's load to begin."""
    import torch.distributed as dist

    stage(LOADING)
    torch.set_num_threads(group.threads)
    device = rank_device(spec.device, rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    config, weights = llama_weights(spec.name, device=device, dtype=spec.dtype,
                                    quantization=spec.quantization)
    local, shard = shard_weights(config, weights, rank, group.world_size)
    model = LlamaModel(local, shard, device=device, dtype=torch_dtype(spec.dtype),
                       reduce=ProcessGroupSum(group.world_size, exact=group.exact))
    stage(JOINING)
    dist.init_process_group(group.backend, init_method=f"tcp://127.0.0.1:{group.port}",
                            rank=rank, world_size=group.world_size,
                            timeout=timedelta(seconds=group.timeout_s))
    stage(READY)
    return model


def encode_batch(b: ForwardBatch) -> list[int]:
    """A ForwardBatch as integers: [T, B, R, ids, positions, slots, query_lens,
    context_lens, table lengths, tables..., logits_indices]."""
    out = [len(b.input_ids), len(b.query_lens), len(b.logits_indices), *b.input_ids,
           *b.positions, *b.slot_mapping, *b.query_lens, *b.context_lens,
           *(len(t) for t in b.block_tables)]
    for t in b.block_tables:
        out.extend(t)
    out.extend(b.logits_indices)
    return out


def decode_batch(v: list[int]) -> ForwardBatch:
    t, b, r = v[:3]
    at = 3

    def take(n: int) -> list[int]:
        nonlocal at
        at += n
        return v[at - n:at]

    ids, positions, slots = take(t), take(t), take(t)
    query_lens, context_lens, lens = take(b), take(b), take(b)
    tables = [take(n) for n in lens]
    return ForwardBatch(ids, positions, slots, query_lens, context_lens, tables, take(r))


def digest(t: torch.Tensor) -> int:
    """A signed 63-bit digest of a tensor's bytes (rank results compared bit for bit)."""
    raw = t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 1


def all_digests(model_last: torch.Tensor, world_size: int) -> list[int]:
    import torch.distributed as dist

    mine = torch.tensor([digest(model_last)], dtype=torch.int64)
    parts = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(parts, mine)
    return [int(p) for p in parts]


def main() -> None:
    """The worker process: its Boot from stdin, then `worker_main`."""
    boot = read_boot(0)
    # Ctrl-C reaches the whole process group; rank 0 decides when the ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=boot.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    channel = WorkerChannel(boot.channel, boot.rank, 0)
    threading.Thread(target=_heartbeat, args=(channel, boot.parent_pid, boot.beat_s),
                     name="nanoserve-tp-heartbeat", daemon=True).start()
    log.info("tensor-parallel rank %d (pid %d): started in %.1f s", boot.rank, os.getpid(),
             time.time() - boot.started_at)
    try:
        model = build_shard(boot.spec, boot.group, boot.rank,
                            _logged_stage(channel, boot.rank))
    except Exception as exc:  # rank 0 names this rank and its stage; one line is enough
        log.error("tensor-parallel rank %d: %s", boot.rank, str(exc).splitlines()[0])
        log.debug("tensor-parallel rank %d failed to start", boot.rank, exc_info=True)
        os._exit(1)
    worker_main(model, boot.group, boot.rank, channel)
    # Nothing is left that the OS does not free, and an interpreter's teardown with torch
    # loaded took about a second (rank 0's close waits for it).
    logging.shutdown()
    os._exit(0)


def _logged_stage(channel: WorkerChannel, rank: int) -> Callable[[int], None]:
    t0 = time.monotonic()

    def stage(s: int) -> None:
        channel.stage(s)
        what = {LOADING: "loading its shard", JOINING: "shard loaded; joining the group",
                READY: "joined the group"}[s]
        log.info("tensor-parallel rank %d: %s (%.1f s)", rank, what, time.monotonic() - t0)

    return stage


def _heartbeat(channel: WorkerChannel, parent_pid: int, every_s: float) -> None:
    while True:
        channel.beat()
        if os.getppid() != parent_pid:  # rank 0 died without a word: do not linger
            os._exit(1)
        time.sleep(every_s)


def worker_main(model: LlamaModel, group: GroupSpec, rank: int,
                channel: WorkerChannel) -> None:
    """Run what rank 0 posts until EXIT (or rank 0 is gone)."""
    import torch.distributed as dist

    last = torch.empty(0)
    try:
        while True:
            command, payload = channel.receive()
            if command == EXIT:
                break
            if command == FORWARD:
                last = model.hidden(decode_batch(payload))
            elif command == COPY:
                model.copy_blocks(list(zip(payload[::2], payload[1::2], strict=True)))
            elif command == INIT_KV:
                model.init_kv_cache(payload[0], payload[1])
            elif command == DIGEST:
                all_digests(last, group.world_size)
            elif command != RESIZE:
                raise ValueError(f"unknown command {command}")
    except RuntimeError as exc:  # a peer gone mid-collective: rank 0 reports the group
        log.error("tensor-parallel rank %d stopped: %s", rank, str(exc).splitlines()[0])
        # At once: leaving a group whose peers are gone can block, and a rank that lingers
        # keeps the others' collectives waiting.
        os._exit(1)
    dist.destroy_process_group()
