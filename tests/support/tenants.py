"""A prefix-heavy workload the fleet tests share: eight tenants, each with its own 128-token
system prompt (8 blocks of 16), 240 requests at 12/s."""

from __future__ import annotations

import random

from nanoserve.sampling.params import SamplingParams
from sim.load.workload import SimRequest, Workload


def tenants(seed: int) -> Workload:
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(1000, 49152) for _ in range(128)) for _ in range(8)]
    reqs = []
    for i in range(240):
        own = tuple(rng.randrange(1000, 49152) for _ in range(rng.randint(8, 48)))
        params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=rng.randint(4, 16))
        reqs.append(SimRequest(f"r{i}", i / 12, prefixes[rng.randrange(8)] + own, params))
    return Workload(tuple(reqs), 12.0, "eight tenants")
