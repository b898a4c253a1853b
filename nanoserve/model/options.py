"""LoadOptions: how `load` (model/__init__.py) loads a model, in one value.

The same settings reach it from `LLM(...)`'s keywords, `serve`'s flags and `bench`'s: one
frozen dataclass, so each of them is named once, here, and the callers pass it whole."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoadOptions:
    """`quantization` (model/quant.py): `auto` keeps a GGUF's own block formats where
    kernels exist, `none` dequantizes to float32, `q8_0`/`q4_0`/`q4_1` quantize to that
    format. `stub_eos_prob`: the stub's chance, per token, that EOS is its top token.
    `tensor_parallel_size` > 1 shards the weights over that many processes
    (model/parallel/), joined by `distributed_backend` (auto: nccl on CUDA, gloo on the
    CPU); `tp_exact` sums the shards' partial outputs in rank order instead of by all-reduce
    (bitwise reproducible against `parallel.emulate`). `distributed_timeout`: seconds the
    ranks may take to start (and the process group's timeout);
    `distributed_heartbeat_timeout`: seconds of silence after which a rank is taken as lost
    (None: parallel/group.py's defaults, 600 and 5). `int8_activations` (model/int8.py):
    the layers' projections of 128 rows or more round their activations to 8 bits, and so
    do batch-1 steps' projections and LM head (csrc/q8dot.cpp): faster, and no longer
    token-identical (CPU, one process)."""

    device: str = "cpu"
    dtype: str = "float32"
    stub_eos_prob: float = 0.0
    quantization: str = "auto"
    tensor_parallel_size: int = 1
    distributed_backend: str = "auto"
    tp_exact: bool = False
    distributed_timeout: float | None = None
    distributed_heartbeat_timeout: float | None = None
    int8_activations: bool = False
