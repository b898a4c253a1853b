"""How long rank 0 takes to hand a step's batch to the other tensor-parallel ranks: through
nanoserve's shared-memory channel (model/parallel/channel.py: write, a byte down each
worker's pipe, wait for every ack) against gloo's `broadcast_object_list` followed by a
barrier, both with 3 ranks on this machine, in one run. Prints the medians in microseconds.
The workers are this script again (`--worker RANK`), started as nanoserve starts its ranks.

    .venv/bin/python scripts/bench_tp_channel.py [--seqs 64] [--reps 500]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from nanoserve.model.base import ForwardBatch
from nanoserve.model.parallel.channel import (
    EXIT,
    FORWARD,
    READY,
    Channel,
    ChannelFiles,
    WorkerChannel,
)
from nanoserve.model.parallel.group import free_port
from nanoserve.model.parallel.worker import decode_batch, encode_batch

WORLD = 3


def batch(seqs: int) -> ForwardBatch:
    """A decode step of `seqs` sequences of 300 tokens (block size 16)."""
    tables = [list(range(s * 19, s * 19 + 19)) for s in range(seqs)]
    return ForwardBatch(list(range(seqs)), [300] * seqs, [t[-1] * 16 for t in tables],
                        [1] * seqs, [301] * seqs, tables, list(range(seqs)))


def worker(rank: int, port: int, files: ChannelFiles, reps: int) -> None:
    channel = WorkerChannel(files, rank, 0)  # woken through stdin
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=60))
    channel.stage(READY)
    while True:
        command, payload = channel.receive()
        if command == EXIT:
            break
        decode_batch(payload)
    for _ in range(reps):
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--reps", type=int, default=500)
    p.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--files", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a.worker, a.port, ChannelFiles(**json.loads(a.files)), a.reps)
        return
    channel = Channel(WORLD)
    port = free_port()
    files = json.dumps(dataclasses.asdict(channel.files))
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), "--port", str(port),
                               "--files", files, "--reps", str(a.reps)], stdin=subprocess.PIPE)
             for r in range(1, WORLD)]
    for r, proc in enumerate(procs, start=1):
        assert proc.stdin is not None
        channel.connect(r, proc.stdin.fileno())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=WORLD, timeout=timedelta(seconds=60))
    b = batch(a.seqs)

    def alive() -> None:
        if any(proc.poll() is not None for proc in procs):
            raise RuntimeError("a worker died")

    channel.wait_acks(0, alive)  # every worker has joined
    channel.unlink()

    shm = []
    for _ in range(a.reps):
        t0 = time.perf_counter()
        channel.send(FORWARD, encode_batch(b), alive)
        channel.wait_acks(channel.seq, alive)
        shm.append(time.perf_counter() - t0)
    channel.send(EXIT, [], alive)
    gloo = []
    for _ in range(a.reps):
        t0 = time.perf_counter()
        dist.broadcast_object_list([b], src=0)
        dist.barrier()
        gloo.append(time.perf_counter() - t0)
    for proc in procs:
        proc.wait()
    dist.destroy_process_group()
    s, g = statistics.median(shm) * 1e6, statistics.median(gloo) * 1e6
    print(f"{a.seqs} sequences, {len(encode_batch(b))} integers, 3 ranks, median of {a.reps}: "
          f"shared memory + pipe {s:.0f} us; gloo broadcast_object_list + barrier "
          f"{g:.0f} us ({g / s:.1f}x)")


if __name__ == "__main__":
    main()
