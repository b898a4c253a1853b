"""Tensor parallelism on torch.distributed: one model's weights over N processes.

    shard.py     which slice of each weight a rank holds, and the sizes that divide
    comm.py      the sum of row-parallel partial outputs: all-reduce, or exact (rank order)
    channel.py   rank 0's per-step commands to the others, through shared memory
    worker.py    ranks 1..N-1: load the shard, join the group, run what rank 0 posts
    group.py     rank 0's `Model`: its own shard plus the spawned ranks
    emulate.py   the same sharding as N threads of one process (the exact mode's oracle)
"""

from nanoserve.model.parallel.group import BACKENDS, TensorParallelModel
from nanoserve.model.parallel.shard import check_tp_size, valid_tp_sizes
from nanoserve.model.parallel.worker import LoadSpec

__all__ = ["BACKENDS", "LoadSpec", "TensorParallelModel", "check_tp_size", "valid_tp_sizes"]
