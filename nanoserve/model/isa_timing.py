"""What `auto` (native.py) times to choose between instruction sets: one row multiplied by
synthetic Q4_0 and Q4_K weights larger than the last-level cache (batch-1 decode's work,
streamed from memory), best of a few passes, the sets taking turns.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

# The measured formats (model/quant.py's FORMATS, which imports native.py and so cannot be
# imported here): weights and bytes per block, and the float16 scales at each block's head
# (Q4_0's d; Q4_K's d, dmin).
_MEASURE_FORMATS = {"q4_0": (32, 18, 1), "q4_k": (256, 144, 2)}  # 4.5 bits a weight each
_MEASURE_COLS = 4096  # a 1-3B model's hidden size: whole blocks of either format
_MEASURE_MIB = 48  # per format at least; more where the last-level cache is larger
_MEASURE_MAX_MIB = 192  # per format at most, whatever the cache: a bound on time and memory
_MEASURE_REPEATS = 5


def time_kernels(ops: Mapping[str, Any]) -> dict[str, float]:
    """Seconds of one row through synthetic weights larger than the last-level cache, by
    instruction set (`ops`: each set's loaded kernels)."""
    row_bytes = _MEASURE_COLS // 32 * 18  # one weight row, in either format
    rows = _measure_bytes() // row_bytes
    return time_decode(ops, decode_weights(rows, _MEASURE_COLS), _MEASURE_COLS)


def _measure_bytes() -> int:
    """Bytes of weights per format: more than the last-level cache holds, so that they
    stream from memory as a model's do at batch-1 decode."""
    mib = 1 << 20
    return min(max(_MEASURE_MIB * mib, _last_level_cache()), _MEASURE_MAX_MIB * mib)


_SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}  # sysfs cache sizes: "32768K"


def _last_level_cache() -> int:
    """Bytes of CPU 0's last-level cache (Linux's sysfs), or 0 where it does not tell."""
    best_level, size = 0, 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        value = (int(text[:-1]) * _SIZE_UNITS[text[-1]] if text[-1:] in _SIZE_UNITS
                 else int(text or 0))
        if level > best_level:
            best_level, size = level, value
    return size


def decode_weights(rows: int, cols: int, seed: int = 0) -> list[tuple[torch.Tensor, str]]:
    """[rows, cols] weights in each measured format (blocks, format): random bytes, as the
    kernels' speed does not depend on them, with every block's float16 scales (d, and Q4_K's
    dmin) set to 0.01 so that no product is subnormal, which would slow it for no reason."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    out = []
    for fmt, (per, size, halves) in _MEASURE_FORMATS.items():
        n = rows * cols // per * size
        # int64 draws, viewed as bytes: eight bytes a draw, several times faster than uint8's
        raw = torch.empty((n + 7) // 8, dtype=torch.int64).random_(generator=g)
        blocks = raw.view(torch.uint8)[:n].view(rows * cols // per, size)
        blocks[:, : 2 * halves] = scale.repeat(halves)
        out.append((blocks.view(rows, -1), fmt))
    return out


def time_decode(ops: Mapping[str, Any], weights: Sequence[tuple[torch.Tensor, str]],
                cols: int, *, repeats: int = _MEASURE_REPEATS,
                timer: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Best-of-`repeats` seconds, by instruction set, of `ops.quant_linear` over one row x
    [1, cols] and every weight [rows, cols] once. The sets take turns within each repeat, so
    that a neighbour's load on a shared machine falls on all of them alike."""
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(1))
    outs = [torch.empty(1, blocks.shape[0]) for blocks, _ in weights]

    def once(o: Any) -> None:
        for (blocks, fmt), out in zip(weights, outs, strict=True):
            o.quant_linear(x, blocks, fmt, out)

    for o in ops.values():
        once(o)  # first touch: page faults and thread start-up are no kernel's time
    best = dict.fromkeys(ops, float("inf"))
    for _ in range(repeats):
        for isa_name, o in ops.items():
            start = timer()
            once(o)
            best[isa_name] = min(best[isa_name], timer() - start)
    return best
