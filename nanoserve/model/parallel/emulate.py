"""Tensor parallelism without processes: N shards of one model as N threads of this process,
summing through `comm.ThreadGroup` in rank order. With the process group's exact mode the
arithmetic is the same operation for operation, so its logits are the bits a real group
must produce: the oracle for `TensorParallelModel(exact=True)`, and a way to test sharding
on any machine."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from nanoserve.model.base import ForwardBatch, ModelConfig
from nanoserve.model.llama import LlamaModel
from nanoserve.model.parallel.comm import ThreadGroup
from nanoserve.model.parallel.shard import shard_weights


def shard_models(config: ModelConfig, weights: Mapping[str, Any], world_size: int,
                 group: ThreadGroup, **model_kwargs: Any) -> list[LlamaModel]:
    """One LlamaModel per rank, each summing through `group`."""
    models = []
    for rank in range(world_size):
        local, shard = shard_weights(config, weights, rank, world_size)
        models.append(LlamaModel(local, shard, reduce=group.member(rank), **model_kwargs))
    return models


def emulate(config: ModelConfig, weights: Mapping[str, Any], world_size: int,
            batches: Sequence[ForwardBatch], *, num_blocks: int, block_size: int,
            threads: int = 1, **model_kwargs: Any
            ) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Run `batches` in order on an emulated N-way group: (rank 0's logits per batch, every
    rank's final hidden states per batch). `threads`: torch threads in each rank's thread,
    as a process group's rank takes them (cores // N)."""
    group = ThreadGroup(world_size)
    models = shard_models(config, weights, world_size, group, **model_kwargs)
    hidden: list[list[torch.Tensor]] = [[] for _ in batches]
    out: list[dict[int, torch.Tensor]] = [{} for _ in range(world_size)]  # ranks 1..N-1
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        m = models[rank]
        try:
            torch.set_num_threads(threads)
            m.init_kv_cache(num_blocks, block_size)
            for i, b in enumerate(batches):
                h = m.hidden(b)
                if rank == 0:
                    hidden[i].append(h)
                else:
                    out[rank][i] = h
        except BaseException as exc:  # reported below; the others must not wait forever
            errors.append(exc)
            group.abort()

    ranks = [threading.Thread(target=run, args=(r,)) for r in range(world_size)]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join()
    if errors:
        raise errors[0]
    for i in range(len(batches)):
        hidden[i].extend(out[r][i] for r in range(1, world_size))
    with torch.no_grad():
        logits = [models[0].lm_head(h[0]).float() for h in hidden]
    return logits, hidden
