"""Where nanoserve keeps what it makes once per machine: converted models (loader.py) and
compiled kernels (native.py). `$NANOSERVE_CACHE`, else ~/.cache/nanoserve."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root(cache_dir: Path | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("NANOSERVE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "nanoserve"
