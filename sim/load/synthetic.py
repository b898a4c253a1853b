"""`sim load`: synthetic virtual-clock traces from a `LoadSpec` (syntax in `sim.load.spec`).

Arrivals come in two stages so that capacity search compares rates fairly. First a seeded
*unit-rate* sequence (mean gap 1 s, first arrival at 0): Poisson (exponential gaps), gamma
(shape = burstiness, scale = 1 / burstiness, so the mean gap stays 1 while the variance is
1 / burstiness, as in vLLM's serving benchmark), or constant. Then a rate profile maps unit
time to seconds: at a fixed rate, t = u / rate, so one seed at twice the rate is the same
arrival pattern compressed in time, and a sweep over rates never confuses a change of rate
with a change of luck. A linear ramp from r0 to r1 over D seconds is the same sequence
warped through the inverse of the cumulative rate Λ(t) = r0 t + (r1 - r0) t² / (2 D)
(the time-change construction of a non-homogeneous process), with r1 held after D; scaling
r0, r1 by k and D by 1/k compresses it the same way.

Every aspect of the load draws from its own `random.Random`, seeded by (seed, aspect name):
arrivals, prompt lengths, output lengths, which requests share the prefix, which hang up,
and the words. So a change of rate moves only at_s, and a change of the output
distribution leaves arrivals and prompts alone. Nothing here reads a clock.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from nanoserve.tokenizer import Tokenizer
from sim.load.azure import PromptSynth, default_engine, read_azure_csv
from sim.load.spec import (
    Lengths,
    LoadSpec,
    SpecError,
    format_load_spec,
    load_spec_from_pairs,
    parse_load_spec,
)
from sim.trace.format import ClientSpec, Trace, TraceHeader, TraceRequest
from sim.trace.loader import load_trace

__all__ = [
    "Lengths", "LoadSpec", "SpecError", "arrival_times", "format_load_spec", "generate_load",
    "load_spec_from_pairs", "parse_load_spec", "ramp_arrivals", "scale_arrivals",
    "unit_arrivals",
]  # fmt: skip

UNIT_KINDS = ("poisson", "gamma", "constant")
# at_s is written in microseconds: far finer than any step, and a trace stays readable.
_AT_S_DIGITS = 6


def _rng(seed: int, aspect: str) -> random.Random:
    # A string seed is hashed with SHA-512 by random.seed: stable across runs and platforms,
    # unlike hash(), which PYTHONHASHSEED salts.
    return random.Random(f"nanoserve-load:{seed}:{aspect}")


def unit_arrivals(kind: str, n: int, seed: int, burstiness: float = 1.0) -> list[float]:
    """`n` arrival times of a unit-rate process, the first at 0. The same seed with a larger
    `n` extends the same sequence."""
    if kind not in UNIT_KINDS:
        raise ValueError(f"kind must be one of {', '.join(UNIT_KINDS)}, got {kind!r}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    rng = _rng(seed, "arrivals")
    times = [0.0] * n
    for i in range(1, n):
        times[i] = times[i - 1] + _unit_gap(kind, rng, burstiness)
    return times


def _unit_gap(kind: str, rng: random.Random, burstiness: float) -> float:
    if kind == "poisson":
        return rng.expovariate(1.0)
    if kind == "gamma":
        return rng.gammavariate(burstiness, 1.0 / burstiness)
    return 1.0


def scale_arrivals(unit: Sequence[float], rate: float) -> list[float]:
    """Unit-rate times at `rate` requests per second: the same pattern, compressed."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    return [u / rate for u in unit]


def ramp_arrivals(
    unit: Sequence[float], rate: float, rate_end: float, duration: float | None = None
) -> list[float]:
    """Unit-rate times under a rate ramping linearly from `rate` to `rate_end` over
    `duration` seconds (by default, long enough that the ramp holds all of `unit` in
    expectation: Λ(D) = D (r0 + r1) / 2 = n - 1), then staying at `rate_end`."""
    if not (rate > 0 and rate_end > 0):
        raise ValueError(f"ramp rates must be > 0, got {rate} and {rate_end}")
    if duration is None:
        duration = 2 * max(len(unit) - 1, 0) / (rate + rate_end)
    if duration <= 0:
        return scale_arrivals(unit, rate_end)
    slope = (rate_end - rate) / duration
    ramp_total = duration * (rate + rate_end) / 2  # Λ(D): unit time the ramp covers
    out = []
    for u in unit:
        if u <= ramp_total:
            # The root of slope t²/2 + rate t = u, in the form that has no cancellation
            # when slope is near 0 (and needs no special case when it is 0).
            out.append(2 * u / (rate + math.sqrt(max(rate * rate + 2 * slope * u, 0.0))))
        else:
            out.append(duration + (u - ramp_total) / rate_end)
    return out


def arrival_times(spec: LoadSpec) -> list[float]:
    """The spec's arrival times in seconds, nondecreasing, the first at 0."""
    if spec.arrival_trace is not None:
        return _trace_times(spec.arrival_trace, spec.n, spec.rate)
    if spec.n is None:
        raise SpecError("n", "is required (how many requests)")
    if spec.rate is None:
        raise SpecError("rate", f"is required with arrival={spec.arrival}")
    kind = "poisson" if spec.arrival == "ramp" else spec.arrival
    unit = unit_arrivals(kind, spec.n, spec.seed, spec.burstiness)
    if spec.rate_end is not None:
        return ramp_arrivals(unit, spec.rate, spec.rate_end, spec.duration)
    return scale_arrivals(unit, spec.rate)


def _trace_times(path: str, n: int | None, rate: float | None) -> list[float]:
    """A trace's (or an Azure CSV's) arrival times from 0; with `rate`, rescaled so that
    the n arrivals average that rate, which makes them a unit sequence like the others."""
    if Path(path).suffix == ".csv":
        rows = read_azure_csv(path)
        times = [(r.t_ns - rows[0].t_ns) / 1e9 for r in rows]
    else:
        trace = load_trace(path)
        if trace.header.clock != "virtual":
            raise SpecError("arrival", f"{path} has clock {trace.header.clock!r}; its times "
                            "must be seconds (a virtual-clock trace)")
        times = [r.at_s or 0.0 for r in trace.requests]
    if n is not None and n > len(times):
        raise SpecError("n", f"{path} has only {len(times)} requests, asked for {n}")
    times = [t - times[0] for t in times[:n]] if times else []
    if not times:
        raise SpecError("arrival", f"{path} has no requests")
    if rate is None:
        return times
    if times[-1] <= 0:
        raise SpecError("rate", f"cannot rescale {path}: its arrivals span no time")
    per_unit = (len(times) - 1) / times[-1]  # unit time per second of the trace
    return scale_arrivals([t * per_unit for t in times], rate)


def _length_sampler(lengths: Lengths, column: str) -> Callable[[random.Random], int]:
    p = lengths.params
    if lengths.kind == "fixed":
        return lambda rng: int(p[0])
    if lengths.kind == "uniform":
        return lambda rng: rng.randint(int(p[0]), int(p[1]))
    if lengths.kind == "normal":
        return lambda rng: max(1, round(rng.gauss(p[0], p[1])))
    if lengths.kind == "lognormal":
        return lambda rng: max(1, round(rng.lognormvariate(math.log(p[0]), p[1])))
    assert lengths.path is not None
    rows = read_azure_csv(lengths.path)
    if not rows:
        raise SpecError(column, f"{lengths.path} has no rows to sample lengths from")
    values = [r.context_tokens if column == "prompt" else r.generated_tokens for r in rows]
    return lambda rng: rng.choice(values)


Shapes = tuple[list[int], list[int], set[int], dict[int, int]]


def draw_shapes(spec: LoadSpec, n: int) -> Shapes:
    """The per-request draws of a load of `n` requests, each aspect from its own seeded
    generator (so changing one distribution leaves the others' draws alone): prompt and
    output lengths, which requests carry the shared prefix, and the frame count after which
    each hanging-up client closes. `sim load` and `sim capacity` share them."""
    assert spec.prompt is not None, "callers check for the SpecError first"
    assert spec.output is not None
    prompt_rng, output_rng = _rng(spec.seed, "prompt"), _rng(spec.seed, "output")
    sample_prompt = _length_sampler(spec.prompt, "prompt")
    sample_output = _length_sampler(spec.output, "output")
    prompts = [sample_prompt(prompt_rng) for _ in range(n)]
    outputs = [sample_output(output_rng) for _ in range(n)]
    # Exact counts, not coin flips: "a fraction f of n requests" is round(f n) of them.
    shared = set(_rng(spec.seed, "prefix").sample(range(n), round(spec.shared_prefix * n)))
    hang_rng = _rng(spec.seed, "hangup")
    hangers = sorted(hang_rng.sample(range(n), round(spec.hangup * n)))
    # Hang up before the last token's frame (frames ~ tokens when streaming).
    frames = {i: hang_rng.randint(0, outputs[i] - 1) for i in hangers}
    return prompts, outputs, shared, frames


def generate_load(
    spec: LoadSpec,
    tokenizer: Tokenizer,
    *,
    engine: Mapping[str, Any] | None = None,
    note: str | None = None,
) -> Trace:
    """A virtual-clock trace for `spec`; the same spec gives the same trace, byte for byte."""
    if spec.prompt is None or spec.output is None:
        raise SpecError("prompt" if spec.prompt is None else "output",
                        "is required (a length distribution, e.g. uniform:32:512)")
    times = arrival_times(spec)
    n = len(times)
    prompts, outputs, shared, frames = draw_shapes(spec, n)

    synth = PromptSynth(tokenizer)
    prefix = ""
    if shared:
        prefix = synth.text(spec.prefix_tokens, _rng(spec.seed, "prefix-text"))
        synth.check(prefix, spec.prefix_tokens)
    text_rng = _rng(spec.seed, "text")
    path = "/v1/chat/completions" if spec.api == "chat" else "/v1/completions"
    requests = []
    for i in range(n):
        own = synth.text(prompts[i], text_rng)
        body = _body(spec, synth, prefix if i in shared else "", own, prompts[i], outputs[i])
        client = ClientSpec(hangup_after_frames=frames.get(i))
        requests.append(TraceRequest(f"r{i + 1}", path, body, client,
                                     at_s=round(times[i], _AT_S_DIGITS)))
    header = TraceHeader("virtual", spec.model, default_engine(engine),
                         note if note is not None else f"sim load {format_load_spec(spec)}")
    return Trace(header, tuple(requests))


def _body(spec: LoadSpec, synth: PromptSynth, prefix: str, own: str, own_tokens: int,
          max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": spec.model}
    if spec.api == "chat":
        # The shared prefix is the system prompt; the template adds its own tokens around
        # the contents (whose counts are the spec's).
        messages = [{"role": "system", "content": prefix}] if prefix else []
        messages.append({"role": "user", "content": synth.check(own, own_tokens)})
        body["messages"] = messages
    elif prefix:
        body["prompt"] = synth.check(f"{prefix} {own}", spec.prefix_tokens + own_tokens)
    else:
        body["prompt"] = synth.check(own, own_tokens)
    # ignore_eos: the spec's output length is the length served, whatever the model says.
    body.update(max_tokens=max_tokens, temperature=0, ignore_eos=True, stream=spec.stream)
    return body
