"""What every `sim` command's command line shares: the error guard and `--engine KEY=VALUE`.

It imports no command, so any command can use it without the import cycle that `cli.py`
(which imports every command) would make.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from nanoserve.config import EngineConfig
from nanoserve.model.loader import resolve_model
from nanoserve.tokenizer import Tokenizer

# The engine settings `--engine` may set on capacity, profile and validate.
ENGINE_KEYS = ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens",
               "prefix_caching", "max_model_len", "seed", "kv_cache_memory")


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
    return EngineConfig(**kw)


def tokenizer(name: str) -> Tokenizer:
    """The tokenizer of model `name` (a name, a .gguf file or a folder), for counting
    prompt tokens without loading weights."""
    return Tokenizer.from_folder(resolve_model(name))
