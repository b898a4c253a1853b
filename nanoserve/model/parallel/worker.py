"""Ranks 1..N-1: each loads its shard, joins the process group, and runs what rank 0 posts
(parallel/channel.py) until told to exit or rank 0 is gone."""

from __future__ import annotations

import hashlib
import logging
import os
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
    RESIZE,
    Channel,
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
    timeout_s: float


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: cuda:r on CUDA (one GPU a rank), the CPU as it is."""
    return f"cuda:{rank}" if torch.device(device).type == "cuda" else device


def build_shard(spec: LoadSpec, group: GroupSpec, rank: int) -> LlamaModel:
    """Join the process group (every rank, rank 0 included) and build this rank's shard."""
    import torch.distributed as dist

    torch.set_num_threads(group.threads)
    device = rank_device(spec.device, rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    dist.init_process_group(group.backend, init_method=f"tcp://127.0.0.1:{group.port}",
                            rank=rank, world_size=group.world_size,
                            timeout=timedelta(seconds=group.timeout_s))
    config, weights = llama_weights(spec.name, device=device, dtype=spec.dtype,
                                    quantization=spec.quantization)
    local, shard = shard_weights(config, weights, rank, group.world_size)
    return LlamaModel(local, shard, device=device, dtype=torch_dtype(spec.dtype),
                      reduce=ProcessGroupSum(group.world_size, exact=group.exact))


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


def worker_main(spec: LoadSpec, group: GroupSpec, rank: int, channel: Channel,
                parent_pid: int) -> None:
    """The process body of rank `rank` (>= 1)."""
    import torch.distributed as dist

    model = build_shard(spec, group, rank)
    channel.ready(rank)
    last = torch.empty(0)
    try:
        while True:
            command, payload = channel.receive(rank, parent_pid)
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
