"""The decode measurements of `nanoserve bench`, besides its workload's run: one sequence
alone (llama-bench's `-n`), many together with the prefill excluded (llama-batched-bench's
TG), and a batch-1 step split into the model's time and the engine's around it."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from nanoserve.config import EngineConfig, SpeculativeConfig
from nanoserve.engine.engine import Engine
from nanoserve.model import Model
from nanoserve.sampling.params import SamplingParams
from nanoserve.tokenizer import Tokenizer

Figures = dict[str, float | int | str]  # a run's figures by name, as the JSON line prints them


class _TimedModel:
    """A model whose forward passes (and greedy picks) are timed: what is left of a step is
    the engine's Python around them (scheduling, batch building, sampling, detokenizing,
    the stop rules)."""

    def __init__(self, model: Model) -> None:
        self._model = model
        self.seconds = 0.0

    def __getattr__(self, name: str) -> object:
        return getattr(self._model, name)

    def _timed(self, fn: Callable[..., object], *args: object) -> object:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds += time.perf_counter() - t0

    def forward(self, batch: object) -> object:
        return self._timed(self._model.forward, batch)

    def pick_greedy(self, batch: object) -> object:
        return self._timed(self._model.pick_greedy, batch)


def step_overhead(model: Model, tok: Tokenizer, prompt: list[int], n: int) -> Figures:
    """Batch-1 decode steps split into the model's time and the engine's time around it,
    ms per step (best of three runs of n - 1 decode steps, by step time)."""
    timed = _TimedModel(model)
    engine = Engine(timed, tok, EngineConfig())  # type: ignore[arg-type]  # a proxy
    best: Figures = {}
    best_step = float("inf")
    for _ in range(3):
        engine.add_request(prompt, SamplingParams(temperature=0.0, ignore_eos=True,
                                                  max_tokens=n))
        engine.step()  # the prefill
        timed.seconds = 0.0
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        step = (time.perf_counter() - t0) / (n - 1)
        if step < best_step:
            best_step = step
            model_ms = timed.seconds / (n - 1) * 1e3
            best = {"step_ms": round(step * 1e3, 3), "model_ms": round(model_ms, 3),
                    "engine_ms": round(step * 1e3 - model_ms, 3),
                    "engine_share": round(1 - model_ms / (step * 1e3), 3)}
    return best


def single_stream(model: Model, tok: Tokenizer, prompt: list[int], n: int,
                  speculative: SpeculativeConfig | None = None) -> float:
    """Decode tokens/s of one sequence alone (after its prefill step), in steady state: one
    short decode first, untimed, as llama-bench warms up (right after the yardsticks' 512 MB
    copy the first decode ran 20% slower: fresh pages and cold caches)."""
    return _decode(_warmed(model, tok, prompt, n, speculative), prompt, n)


def _warmed(model: Model, tok: Tokenizer, prompt: list[int], n: int,
            speculative: SpeculativeConfig | None) -> Engine:
    """An engine that has decoded `prompt` once, min(n, 8) tokens, untimed."""
    engine = Engine(model, tok, EngineConfig(speculative=speculative))
    _decode(engine, prompt, min(n, 8))
    return engine


def _decode(engine: Engine, prompt: list[int], n: int) -> float:
    """Tokens/s of one request of `n` tokens, its prefill step (and first token) untimed."""
    engine.add_request(prompt, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n))
    engine.step()
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return (n - 1) / (time.perf_counter() - t0)


def shares_of_bound(model: Model, tok: Tokenizer, prompt: list[int], weight_bytes: int,
                    read: Callable[[int], float], rounds: int, n: int,
                    speculative: SpeculativeConfig | None = None) -> list[float]:
    """Batch-1 decode's share of the read-bandwidth bound, `rounds` times: each round reads
    the weights' size (`read`, best of three) and then decodes `n` tokens, one engine for
    every round, warmed once (single_stream's warm-up). On a shared host the read speed and
    the decode each drift by tens of percent within a minute (a 1B: 57-91% from round to
    round, seconds apart), so a decode and a read timed a minute apart compare two
    machines; a round compares one."""
    engine = _warmed(model, tok, prompt, n, speculative)
    shares = []
    for _ in range(rounds):
        bound = read(3) / weight_bytes
        shares.append(_decode(engine, prompt, n) / bound)
    return shares


def paired_shares(model: Model, tok: Tokenizer, prompt: list[int], weight_bytes: int,
                  read: Callable[[int], float], n: int,
                  speculative: SpeculativeConfig | None = None) -> list[tuple[float, float]]:
    """Batch-1 decode beside the read-bandwidth bound step by step: before each decode step
    one read of the weights' size is timed (`read(1)`). Returns, a step each, the seconds
    that read takes for the step's tokens (the bound's time) and the step's own seconds;
    their sums' ratio is the decode's share of the bound over the same seconds. A round
    (shares_of_bound) sets the best of three reads against the mean of a decode of a second
    or more: the peak of a drifting read speed against an average. Here both are
    sums of single measurements, tens of milliseconds apart: like for like. Only for weights
    that do not share the last-level cache with the read (bench's _paired_line says)."""
    engine = _warmed(model, tok, prompt, n, speculative)
    engine.add_request(prompt, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n))
    engine.step()  # the prefill (and first token), as _decode leaves it untimed
    pairs = []
    while engine.has_unfinished():
        read_s = weight_bytes / read(1)
        t0 = time.perf_counter()
        tokens = sum(len(u.new_token_ids) for u in engine.step().updates)
        pairs.append((tokens * read_s, time.perf_counter() - t0))
    return pairs


def batched_decode(model: Model, tok: Tokenizer, seqs: int, prompt_len: int, n: int,
                   seed: int = 0) -> float:
    """Decode tokens/s of `seqs` sequences together, prefill excluded: llama-batched-bench's
    TG figure (`-npp prompt_len -ntg n -npl seqs`). Every prompt is prefilled first (untimed),
    then the decode-only steps after the first are timed and their tokens counted."""
    rng = random.Random(seed)
    engine = Engine(model, tok, EngineConfig(max_num_seqs=seqs,
                                             max_num_batched_tokens=seqs * prompt_len))
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)
    for _ in range(seqs):
        engine.add_request([rng.randrange(100, model.config.vocab_size - 100)
                            for _ in range(prompt_len)], params)
    while engine.step().num_prefill_tokens:  # untimed: the prefill, then one decode step
        pass
    decoded, t0 = 0, time.perf_counter()
    while engine.has_unfinished():
        decoded += sum(len(u.new_token_ids) for u in engine.step().updates)
    return decoded / (time.perf_counter() - t0) if decoded else 0.0
