"""Synthetic load specs: `n=200,arrival=poisson,rate=4,prompt=uniform:32:512,...`.

One parser serves `sim load --load SPEC`, the individual `sim load` flags (which the CLI
turns into the same key=value pairs) and capacity planning, which parses a spec once and
varies `rate` with `dataclasses.replace`. So a spec may leave out what a sweep supplies
(n, rate): `LoadSpec` checks the ranges and combinations of what is given, and
`generate_load` checks that everything it needs is there.

The keys are in KEYS_HELP below (also `sim load --help`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Literal

ARRIVALS = ("poisson", "gamma", "constant", "ramp", "trace")
KEYS_HELP = """\
Keys (defaults in brackets):
  n              number of requests (with arrival=trace: [all of the trace's])
  arrival        poisson | gamma | constant | ramp | trace:PATH [poisson]; ramp is poisson
                 with rate_end; trace takes the at_s of a virtual trace or an Azure CSV
  rate           mean requests/s; with trace:PATH, rescales the times to this mean rate
  rate_end       the rate ramps linearly from `rate` to this over `duration`, then holds
  duration       seconds of the ramp [so that the n requests fill it, in expectation]
  burstiness     gamma shape: < 1 burstier than Poisson, > 1 more regular [1]
  prompt, output fixed:N | uniform:LO:HI | normal:MEAN:STD | lognormal:MEDIAN:SIGMA |
                 empirical:PATH (an Azure-format CSV: ContextTokens for prompt,
                 GeneratedTokens for output); normal/lognormal round, then clip to >= 1
  shared_prefix  FRACTION:TOKENS: round(FRACTION n) requests start with one common prompt of
                 TOKENS tokens (the system message with api=chat), then their own [0]
  api            completions | chat [completions]
  stream         true | false [false]
  hangup         FRACTION: round(FRACTION n) requests hang up after k SSE frames, k uniform
                 in [0, max_tokens - 1] (needs stream) [0]
  seed           [0]
  model          the header's and the bodies' model name [stub]
"""

LENGTH_KINDS = {"fixed": 1, "uniform": 2, "normal": 2, "lognormal": 2, "empirical": 1}


class SpecError(ValueError):
    """A load spec that cannot work; the message names the key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"load spec: {key}: {message}")
        self.key = key


@dataclass(frozen=True, slots=True)
class Lengths:
    """A token-length distribution. `params` by kind: fixed (N), uniform (LO, HI inclusive),
    normal (MEAN, STD), lognormal (MEDIAN, SIGMA of the log); empirical has `path`."""

    kind: str
    params: tuple[float, ...] = ()
    path: str | None = None

    def __str__(self) -> str:
        if self.kind == "empirical":
            return f"empirical:{self.path}"
        return ":".join([self.kind, *(_num(p) for p in self.params)])


@dataclass(frozen=True, slots=True)
class LoadSpec:
    n: int | None = None
    arrival: str = "poisson"
    arrival_trace: str | None = None  # the PATH of arrival=trace:PATH
    rate: float | None = None
    rate_end: float | None = None
    duration: float | None = None
    burstiness: float = 1.0
    prompt: Lengths | None = None
    output: Lengths | None = None
    shared_prefix: float = 0.0
    prefix_tokens: int = 0
    api: Literal["completions", "chat"] = "completions"
    stream: bool = False
    hangup: float = 0.0
    seed: int = 0
    model: str = "stub"

    def __post_init__(self) -> None:
        if self.n is not None and self.n < 1:
            raise SpecError("n", f"must be >= 1, got {self.n}")
        if self.arrival not in ARRIVALS:
            raise SpecError("arrival", f"must be one of {', '.join(ARRIVALS)}, got "
                            f"{self.arrival!r}")
        if (self.arrival == "trace") != (self.arrival_trace is not None):
            raise SpecError("arrival", "trace:PATH names the trace or CSV to take times from")
        for key in ("rate", "rate_end", "duration"):
            value = getattr(self, key)
            if value is not None and not value > 0:
                raise SpecError(key, f"must be > 0, got {value}")
        if self.arrival == "ramp" and self.rate_end is None:
            raise SpecError("rate_end", "arrival=ramp needs the rate it ramps to")
        if self.rate_end is not None and self.arrival == "trace":
            raise SpecError("rate_end", "a trace's own timestamps cannot also ramp")
        if self.duration is not None and self.rate_end is None:
            raise SpecError("duration", "is the length of a ramp; give rate_end too")
        if not self.burstiness > 0:
            raise SpecError("burstiness", f"must be > 0, got {self.burstiness}")
        if self.burstiness != 1 and self.arrival != "gamma":
            raise SpecError("burstiness", "applies to arrival=gamma only")
        for key in ("shared_prefix", "hangup"):
            value = getattr(self, key)
            if not 0 <= value <= 1:
                raise SpecError(key, f"the fraction must be in [0, 1], got {value}")
        if self.shared_prefix > 0 and self.prefix_tokens < 1:
            raise SpecError("shared_prefix", "FRACTION:TOKENS needs TOKENS >= 1")
        if self.api not in ("completions", "chat"):
            raise SpecError("api", f"must be completions or chat, got {self.api!r}")
        if self.hangup > 0 and not self.stream:
            raise SpecError("hangup", "needs stream=true: a hang-up counts SSE frames")
        if self.seed < 0:
            raise SpecError("seed", f"must be >= 0, got {self.seed}")
        if not self.model:
            raise SpecError("model", "must be a non-empty name")


def parse_load_spec(s: str) -> LoadSpec:
    """`key=value,key=value,...` -> LoadSpec (keys and syntax in the module docstring)."""
    return load_spec_from_pairs(split_load_spec(s))


def split_load_spec(s: str) -> dict[str, str]:
    """`key=value,...` -> {key: value}, unconverted: the CLI lays its flags over this."""
    pairs: dict[str, str] = {}
    for item in s.split(","):
        if not item.strip():
            continue
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq:
            raise SpecError(key, "expected key=value")
        if key in pairs:
            raise SpecError(key, "given twice")
        pairs[key] = value.strip()
    return pairs


def load_spec_from_pairs(pairs: Mapping[str, str]) -> LoadSpec:
    """The same, from a key -> value-string mapping (what the CLI's flags become)."""
    known = {f.name for f in fields(LoadSpec)} - {"arrival_trace", "prefix_tokens"}
    unknown = sorted(set(pairs) - known)
    if unknown:
        raise SpecError(unknown[0], f"unknown key; known keys: {', '.join(sorted(known))}")
    kw: dict[str, object] = {}
    for key, value in pairs.items():
        if key in ("n", "seed"):
            kw[key] = _int(key, value)
        elif key in ("rate", "rate_end", "duration", "burstiness", "hangup"):
            kw[key] = _float(key, value)
        elif key == "arrival":
            kind, _, path = value.partition(":")
            kw["arrival"] = kind
            if kind == "trace":
                kw["arrival_trace"] = path or None
            elif path:
                raise SpecError("arrival", f"only trace takes a :PATH, got {value!r}")
        elif key in ("prompt", "output"):
            kw[key] = parse_lengths(key, value)
        elif key == "shared_prefix":
            frac, _, tokens = value.partition(":")
            kw["shared_prefix"] = _float(key, frac)
            kw["prefix_tokens"] = _int(key, tokens) if tokens else 0
        elif key == "stream":
            if value.lower() not in ("true", "false", "1", "0"):
                raise SpecError(key, f"must be true or false, got {value!r}")
            kw[key] = value.lower() in ("true", "1")
        else:  # api, model
            kw[key] = value
    return LoadSpec(**kw)  # type: ignore[arg-type]  # the values were converted per key


def parse_lengths(key: str, value: str) -> Lengths:
    kind, _, rest = value.partition(":")
    if kind not in LENGTH_KINDS:
        raise SpecError(key, f"must be one of {', '.join(f'{k}:...' for k in LENGTH_KINDS)}, "
                        f"got {value!r}")
    if kind == "empirical":
        if not rest:
            raise SpecError(key, "empirical:PATH needs the path of an Azure-format CSV")
        return Lengths(kind, path=rest)
    parts = rest.split(":") if rest else []
    if len(parts) != LENGTH_KINDS[kind]:
        raise SpecError(key, f"{kind} takes {LENGTH_KINDS[kind]} number(s), got {value!r}")
    params = tuple(_float(key, p) for p in parts)
    if kind in ("fixed", "uniform") and not all(p == int(p) >= 1 for p in params):
        raise SpecError(key, f"{kind} lengths must be integers >= 1, got {value!r}")
    if kind == "uniform" and params[0] > params[1]:
        raise SpecError(key, f"uniform:LO:HI needs LO <= HI, got {value!r}")
    if kind == "normal" and params[1] < 0:
        raise SpecError(key, f"normal:MEAN:STD needs STD >= 0, got {value!r}")
    if kind == "lognormal" and (params[0] <= 0 or params[1] < 0):
        raise SpecError(key, f"lognormal:MEDIAN:SIGMA needs MEDIAN > 0, SIGMA >= 0, got "
                        f"{value!r}")
    return Lengths(kind, params)


def format_load_spec(spec: LoadSpec) -> str:
    """The canonical spec string: keys in a fixed order, defaults left out, so that
    `parse_load_spec(format_load_spec(s)) == s` and equal specs print the same."""
    default = LoadSpec()
    out: list[str] = []
    for f in fields(LoadSpec):
        if f.name in ("arrival_trace", "prefix_tokens"):
            continue  # printed as part of arrival and shared_prefix
        value = getattr(spec, f.name)
        if f.name == "shared_prefix":
            if (value, spec.prefix_tokens) == (default.shared_prefix, default.prefix_tokens):
                continue
            value = f"{_num(value)}:{spec.prefix_tokens}"
        elif value == getattr(default, f.name):
            continue
        elif f.name == "arrival" and spec.arrival_trace is not None:
            value = f"trace:{spec.arrival_trace}"
        elif isinstance(value, bool):
            value = str(value).lower()
        elif isinstance(value, float):
            value = _num(value)
        out.append(f"{f.name}={value}")
    return ",".join(out)


def _num(x: float) -> str:
    # Exact (repr), so a printed spec parses back to the same floats; "4" rather than "4.0".
    return str(int(x)) if x.is_integer() else repr(x)


def _int(key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise SpecError(key, f"must be an integer, got {value!r}") from None


def _float(key: str, value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise SpecError(key, f"must be a number, got {value!r}") from None
    if not math.isfinite(x):
        raise SpecError(key, f"must be a finite number, got {value!r}")
    return x
