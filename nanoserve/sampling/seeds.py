"""The 64-bit mix every seeded choice in nanoserve derives from.

splitmix64's finaliser is a bijection on 64-bit integers that spreads every input bit over
the output: `mix64(mix64(a) ^ b)` hashes the pair (a, b) well enough for per-request seeds
(the engine), per-token uniforms (the sampler) and the stub model's made-up logits, and it
is the same on every platform and Python version, which `random` and `hash` are not. One
module, so that the engine needs nothing from the stub and the three agree by
construction.
"""

from __future__ import annotations

import numpy as np

MASK64 = (1 << 64) - 1


def mix64(x: int) -> int:
    """splitmix64's finaliser of `x` (taken modulo 2**64)."""
    x = ((x & MASK64) + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def mix64_array(x: np.ndarray) -> np.ndarray:
    """`mix64` over a uint64 array (numpy's uint64 arithmetic wraps at 2**64, as the masks
    do)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))
