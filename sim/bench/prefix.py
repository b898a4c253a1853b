"""`sim bench --prefix-test`: what prefix caching buys a chat that repeats a system prompt.

Sequential streaming chat requests share one long system prompt (1,000 tokens by default)
and differ in a short user message. The first is cold: nothing of its prompt is cached, so
the server prefills all of it. The later ones are warm: a server with prefix caching finds
the system prompt's KV blocks and prefills only the rest. The figure is the warm requests'
median TTFT over the cold one's.

Two things keep the cold figure honest. A warm-up request with a *different* system prompt
of the same length goes first, so the cold one does not also pay the server's first-request
costs (allocator growth, lazy initialisation). And the system prompt is drawn from a fresh
seed on every run (printed, and fixed by `--seed`), so a second run against the same server
is cold again instead of hitting what the first one left cached.
"""

from __future__ import annotations

import random
import secrets
import statistics
from dataclasses import dataclass
from typing import Any

import httpx
import trio

from sim.bench.client import BenchRequest, Now, prepare_body, send_one
from sim.bench.records import RequestRecord
from sim.load.azure import PromptSynth

CHAT = "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class PrefixResult:
    seed: int
    prefix_tokens: int
    warmup: RequestRecord
    cold: RequestRecord
    warm: list[RequestRecord]

    @property
    def ratio(self) -> float | None:
        """median(warm TTFT) / cold TTFT, or None when a request failed."""
        warm = [r.ttft_s for r in self.warm if r.ok and r.ttft_s is not None]
        if not warm or not self.cold.ok or not self.cold.ttft_s:
            return None
        return statistics.median(warm) / self.cold.ttft_s

    def to_json(self) -> dict[str, Any]:
        ratio = self.ratio
        return {
            "seed": self.seed, "prefix_tokens": self.prefix_tokens,
            "cold_ttft_ms": _ms(self.cold.ttft_s),
            "warm_ttft_ms": [_ms(r.ttft_s) for r in self.warm],
            "ratio": None if ratio is None else round(ratio, 4),
            "requests": [r.to_json() for r in (self.warmup, self.cold, *self.warm)],
        }  # fmt: skip


def _ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1000, 3)


def prefix_requests(
    synth: PromptSynth, *, seed: int, model: str, prefix_tokens: int = 1000, n: int = 5,
    user_tokens: int = 16, max_tokens: int = 4,
) -> list[BenchRequest]:
    """The warm-up request, then `n` requests sharing one system prompt (the first of them
    cold). Every text has an exact token count under the synthesiser's tokenizer."""
    if n < 2:
        raise ValueError(f"the prefix test needs n >= 2 (one cold, one warm), got {n}")
    rng = random.Random(f"nanoserve-prefix:{seed}")
    shared = synth.check(synth.text(prefix_tokens, rng), prefix_tokens)
    other = synth.check(synth.text(prefix_tokens, rng), prefix_tokens)
    out = []
    for i, system in enumerate([other, *[shared] * n]):
        body = {
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": synth.text(user_tokens, rng)}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        }  # fmt: skip
        out.append(BenchRequest("warmup" if i == 0 else f"p{i}", CHAT,
                                prepare_body(body, model=model, stream=True)))
    return out


async def run_prefix_test(
    client: httpx.AsyncClient, url: str, requests: list[BenchRequest], *, seed: int,
    prefix_tokens: int, now: Now = trio.current_time,
) -> PrefixResult:
    """Send the requests one after another (each waits for the last to finish)."""
    t0 = now()
    records = [await send_one(client, url, req, t0, now) for req in requests]
    return PrefixResult(seed, prefix_tokens, records[0], records[1], records[2:])


def fresh_seed() -> int:
    return secrets.randbits(31)
