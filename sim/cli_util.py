"""What every `sim` command's command line shares: the error guard, `--engine KEY=VALUE` and
the trace options (`--trace FILE`, its format, window and time scale).

It imports no command, so any command can use it without the import cycle that `commands.py`
(which imports every command) would make.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from nanoserve import flags
from nanoserve.config import EngineConfig, SpeculativeConfig
from nanoserve.model.loader import resolve_model
from nanoserve.tokenizer import Tokenizer
from sim.load.public import FORMATS

# The engine settings `--engine` may set on capacity, profile and validate.
ENGINE_KEYS = ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens",
               "prefix_caching", "max_model_len", "seed", "kv_cache_memory",
               "speculative_config")


def guarded(run: Callable[[argparse.Namespace], int],
            *also: type[Exception]) -> Callable[[argparse.Namespace], int]:
    """`run(args)` as a `main`: a bad spec, flag or path (ValueError, OSError, and the
    errors in `also`) is one line and exit status 2."""
    errors: tuple[type[Exception], ...] = (ValueError, OSError, *also)

    def main(a: argparse.Namespace) -> int:
        try:
            return int(run(a))
        except errors as exc:
            print(f"sim {a.cmd}: {exc}", file=sys.stderr)
            return 2

    return main


def engine_overrides(pairs: list[str]) -> dict[str, Any]:
    """`["block_size=32", "prefix_caching=false"]` -> {"block_size": 32, ...}."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, eq, raw = pair.partition("=")
        if not eq or not key:
            raise ValueError(f"--engine takes key=value, got {pair!r}")
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw  # a bare string such as a sha256
    return out


def engine_config(pairs: list[str]) -> EngineConfig:
    """An EngineConfig from `--engine` pairs, each key one of ENGINE_KEYS."""
    kw = engine_overrides(pairs)
    bad = sorted(set(kw) - set(ENGINE_KEYS))
    if bad:
        raise ValueError(f"--engine {bad[0]}: not an engine setting ({', '.join(ENGINE_KEYS)})")
    memory = kw.get("kv_cache_memory")
    if isinstance(memory, str):  # a size as serve's --kv-cache-memory takes it: 2GiB
        try:
            kw["kv_cache_memory"] = flags.size_bytes(memory)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"--engine kv_cache_memory: {exc}") from None
    if "speculative_config" in kw:  # vLLM's JSON, as serve's --speculative-config takes it
        kw["speculative"] = SpeculativeConfig.parse(kw.pop("speculative_config"))
    return EngineConfig(**kw)


def tokenizer(name: str) -> Tokenizer:
    """The tokenizer of model `name` (a name, a .gguf file or a folder), for counting
    prompt tokens without loading weights."""
    return Tokenizer.from_folder(resolve_model(name))


def add_trace_args(p: argparse.ArgumentParser, *, flag: bool = True) -> None:
    """`--trace FILE` (unless `flag` is False: the caller has its own) and the options of
    public traces (sim.load.public): format, window, time scale, prefix structure."""
    g = p.add_argument_group("traces (nanoserve's, or Mooncake, Alibaba, BurstGPT, Azure)")
    if flag:
        g.add_argument("--trace", type=flags.input_file, metavar="FILE",
                       help="a nanoserve virtual-clock trace or a public trace file")
    g.add_argument("--trace-format", choices=("nanoserve", *FORMATS),
                   help="the trace's format [detected from its first line]")
    g.add_argument("--start", type=flags.non_negative_float, default=0.0, metavar="S",
                   help="skip the trace's first S seconds [0]")
    g.add_argument("--duration", type=flags.positive_float, metavar="S",
                   help="keep S seconds of the trace from --start [all]")
    g.add_argument("--speedup", type=flags.positive_float, default=1.0, metavar="X",
                   help="replay X times faster than recorded [1]")
    g.add_argument("--ignore-prefixes", action="store_true",
                   help="prompts share no blocks even where the trace's hash_ids say so")
    g.add_argument("--trace-seed", type=flags.non_negative_int, default=0, metavar="N",
                   help="seed of the synthetic prompt tokens [0]")


def trace_options(a: argparse.Namespace) -> dict[str, Any]:
    """add_trace_args' options as file_workload's (and text_trace's) keywords."""
    return {"fmt": a.trace_format, "start_s": a.start, "duration_s": a.duration,
            "speedup": a.speedup, "prefixes": not a.ignore_prefixes, "seed": a.trace_seed}
