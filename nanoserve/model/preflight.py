"""A model setting judged before anything loads: the device, the tensor-parallel size, the KV
pool against the model's context and against the machine's memory.

`nanoserve serve` and `nanoserve bench` call these after argparse has checked each flag
alone and before they load a weight or bind a socket, so a setting that can never work is
one line naming the flag (ConfigError; `ConfigError.cli_text` spells engine settings as
flags) instead of a traceback from torch, or a server that binds, logs "listening" and then
dies loading. Everything here reads metadata only (`kv_geometry`, `peek_config`).
"""

from __future__ import annotations

import os

import torch

from nanoserve.config import ConfigError, EngineConfig, KVLayout
from nanoserve.model import kv_geometry
from nanoserve.model.loader import peek_config
from nanoserve.model.parallel import check_tp_size

DEVICE_TYPES = ("cpu", "cuda")


def check_device(device: str) -> None:
    """`device` names a device torch can use here: cpu, or cuda[:N] with CUDA present."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ConfigError(f"--device {device}: not a device (cpu, cuda or cuda:N)") from None
    if dev.type not in DEVICE_TYPES:
        raise ConfigError(f"--device {device}: nanoserve runs on cpu or cuda, not {dev.type}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            built = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else \
                "built without CUDA"
            raise ConfigError(f"--device {device}: CUDA is not available here (torch "
                              f"{torch.__version__}, {built})")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ConfigError(f"--device {device}: there are {count} CUDA device(s), "
                              f"cuda:0 to cuda:{count - 1}")


def memory_bytes(device: str) -> int:
    """The memory one process on `device` can fill: the GPU's, or the machine's RAM."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.get_device_properties(dev.index or 0).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_model(model: str, dtype: str, tp: int, cfg: EngineConfig, device: str,
                backend: str = "auto") -> KVLayout:
    """The layout `cfg` comes to on `model`, refusing (ConfigError, flags named) a
    tensor-parallel size it does not shard at, a pool that cannot hold one sequence, and a
    pool larger than the memory it would live in. Call `check_device` first."""
    if tp != 1:
        if model == "stub":
            raise ConfigError("--tensor-parallel-size: the stub model has no weights to shard")
        if backend == "nccl" and torch.device(device).type != "cuda":
            raise ConfigError(f"--distributed-backend nccl needs a CUDA --device, not "
                              f"{device} (gloo runs on the CPU)")
        try:
            check_tp_size(peek_config(model), tp, "--tensor-parallel-size")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        except OSError:
            pass  # kv_geometry names the model that cannot be read
    try:
        context_len, per_token = kv_geometry(model, dtype, tp)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--model {model}: {exc}") from None
    block_bytes = per_token * cfg.block_size
    layout = cfg.layout(context_len, block_bytes)
    # On the CPU every rank's pool lives in the one machine's memory; each GPU holds its own.
    ranks = tp if torch.device(device).type == "cpu" else 1
    need = ranks * (layout.num_blocks * block_bytes if cfg.num_blocks is not None
                    else cfg.kv_cache_memory)
    have = memory_bytes(device)
    if need > have:
        sized = "num_blocks" if cfg.num_blocks is not None else "kv_cache_memory"
        on = "this machine's memory" if torch.device(device).type == "cpu" else \
            f"the memory of {device}"
        per = f" ({ranks} ranks)" if ranks > 1 else ""
        raise ConfigError(f"the KV pool{per} takes {need} B, more than {on} ({have} B): "
                          f"lower {sized}")
    return layout


def check_int8_activations(model: str, tensor_parallel_size: int, device: str) -> None:
    """--int8-activations runs on real weights, on the CPU, in one process (model/int8.py)."""
    why = ("--model stub has no weights" if model == "stub" else
           f"--tensor-parallel-size {tensor_parallel_size}: it runs in one process"
           if tensor_parallel_size != 1 else
           f"--device {device}: it runs on the CPU" if device != "cpu" else None)
    if why is not None:
        raise ConfigError(f"--int8-activations: {why}")
