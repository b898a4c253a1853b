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


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1, _MUL2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S27, _S30, _S31 = np.uint64(27), np.uint64(30), np.uint64(31)


def mix64_array(x: np.ndarray) -> np.ndarray:
    """`mix64` over a uint64 array (numpy's uint64 arithmetic wraps at 2**64, as the masks
    do); a new array. The constants are made once and the rounds run in place: on the
    stub's arrays of a few dozen rows numpy's per-call overhead is the whole cost."""
    x = x + _GOLDEN
    x ^= x >> _S30
    x *= _MUL1
    x ^= x >> _S27
    x *= _MUL2
    x ^= x >> _S31
    return x
