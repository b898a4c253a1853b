"""Tensor parallelism on torch.distributed: one model's weights over N processes.

    shard.py     which slice of each weight a rank holds, and the sizes that divide
    comm.py      the sum of row-parallel partial outputs: all-reduce, or exact (rank order)
    channel.py   rank 0's per-step commands to the others, through shared memory
    launch.py    starting a rank: a fresh interpreter (never the user's script again)
    worker.py    ranks 1..N-1: load the shard, join the group, run what rank 0 posts
    watch.py     rank 0's watch: a rank that exits or stops beating is lost
    group.py     rank 0's `Model`: its own shard plus the worker ranks
    startup.py   rank 0's wait for the group to start, and a failed start's one error
    emulate.py   the same sharding as N threads of one process (the exact mode's oracle)
"""

from nanoserve.model.parallel.group import (
    BACKENDS,
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    TensorParallelModel,
)
from nanoserve.model.parallel.shard import check_tp_size, valid_tp_sizes
from nanoserve.model.parallel.worker import LoadSpec

__all__ = ["BACKENDS", "DEFAULT_HEARTBEAT_TIMEOUT_S", "DEFAULT_TIMEOUT_S", "LoadSpec",
           "TensorParallelModel", "check_tp_size", "valid_tp_sizes"]
