"""nanoserve.sampling.seeds: the one 64-bit mix, and the copies that speed keeps inlined."""

from __future__ import annotations

import numpy as np

from nanoserve.model.stub import row_hash
from nanoserve.sampling.seeds import MASK64, mix64, mix64_array

# splitmix64 seeded with 0: its first outputs are mix64 of 1, 2, 3 times the golden gamma
# (published values of the generator, so the constants cannot drift unnoticed).
GAMMA = 0x9E3779B97F4A7C15


def test_mix64_is_splitmix64() -> None:
    assert [mix64(k * GAMMA - GAMMA) for k in (1, 2, 3)] == [
        0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_mix64_takes_its_input_modulo_2_64() -> None:
    for x in (0, 1, 12345, MASK64):
        assert mix64(x + (7 << 64)) == mix64(x) == mix64(x - (1 << 64) * 3)


def test_the_array_form_equals_the_scalar_one() -> None:
    xs = [0, 1, 2**63, MASK64, 0xDEADBEEF, 42 << 40]
    got = mix64_array(np.array(xs, dtype=np.uint64))
    assert [int(v) for v in got] == [mix64(x) for x in xs]


def test_the_stubs_inlined_hash_is_mix64_chained() -> None:
    # The stub's row_hash inlines mix64 for speed; it must stay the chain it documents.
    for seed, length, tail in [(0, 0, ()), (5, 17, (3, 9, 11, 2)), (MASK64, 3, (1,)),
                               (-1, 8192, (49151, 0, 7, 7))]:
        want = seed & MASK64
        for x in (0, length, *tail):
            want = mix64(want ^ x)
        assert row_hash(length, tail, seed) == want
