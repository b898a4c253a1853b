"""Per-point metrics of a capacity run, computed from the per-request records alone.

Definitions (the same for a simulated run and for `sim validate`'s measured one, which is
what makes the two comparable):

- Warm-up: the first `warmup` fraction of requests, by arrival, are run but not measured,
  so an empty server's first seconds do not flatter the percentiles.
- Window: from the first measured arrival to the last measured request's end.
- TTFT: first token's time - arrival. TPOT: (last token - first token) / (tokens - 1), for
  requests with two tokens or more. ITL: every gap between consecutive tokens of a request,
  pooled. E2E: end - arrival. Latencies count finished requests (status ok) only.
- Throughput: finished requests, and output tokens of every measured request, per second
  of the window. Goodput: finished requests that met every per-request SLO, per second.
- Percentiles interpolate linearly between order statistics (numpy's default), so a test
  can recompute them from the records.
- Queue and KV usage: time-weighted over the window, per replica (an idle replica counts
  zero); their maxima over the steps in it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sim.capacity.fleet import Record, Sample, SimResult
from sim.stats import PERCENTILES, parse_slo_items, percentile_or_none

LATENCIES = ("ttft", "tpot", "itl", "e2e")


@dataclass(frozen=True, slots=True)
class Slo:
    """Targets such as {"ttft": (99, 2.0), "tpot": (99, 0.2)}: metric -> (percentile, s)."""

    targets: tuple[tuple[str, float, float], ...]

    def __str__(self) -> str:
        return ",".join(f"{m}_p{_num(p)}={_num(s * 1000)}ms" for m, p, s in self.targets)

    def met_by(self, summary: dict[str, Any]) -> bool:
        for metric, p, target in self.targets:
            got = summary["latency"][metric].get(f"p{_num(p)}")
            if got is None:
                got = percentile_or_none(summary["_values"][metric], p)
            if got is None or got > target:
                return False
        return True


def parse_slo(text: str) -> Slo:
    """`ttft_p99=2s,tpot_p99=200ms` -> Slo (sim/stats.py reads the items)."""
    return Slo(tuple((metric, p, secs) for metric, p, secs
                     in parse_slo_items(text, LATENCIES, percentile=True) if p is not None))


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def latencies(records: Sequence[Record]) -> dict[str, list[float]]:
    """TTFT, TPOT, ITL and E2E samples of the finished requests, in record order."""
    out: dict[str, list[float]] = {k: [] for k in LATENCIES}
    for r in records:
        if r.status != "ok" or r.first_token_s is None or r.finish_s is None:
            continue
        out["ttft"].append(r.first_token_s - r.arrival_s)
        out["e2e"].append(r.finish_s - r.arrival_s)
        tt = r.token_times
        if len(tt) >= 2:
            out["tpot"].append((tt[-1] - tt[0]) / (len(tt) - 1))
            out["itl"].extend(b - a for a, b in zip(tt, tt[1:], strict=False))
    return out


def measured(records: Sequence[Record], warmup: float) -> list[Record]:
    if not 0 <= warmup < 1:
        raise ValueError(f"warmup must be a fraction in [0, 1), got {warmup}")
    order = sorted(records, key=lambda r: r.arrival_s)  # stable: ties keep record order
    return order[math.floor(warmup * len(order)):]


def summarize(result: SimResult, *, warmup: float, slo: Slo | None, num_blocks: int,
              replicas: int = 1) -> dict[str, Any]:
    """The point's metrics (module docstring). `_values` holds the raw latency samples for
    pooling across seeds; reports drop it."""
    recs = measured(result.records, warmup)
    status = {s: sum(r.status == s for r in recs) for s in
              ("ok", "rejected", "aborted", "failed", "invalid")}
    start = recs[0].arrival_s if recs else 0.0
    ends = [r.finish_s for r in recs if r.finish_s is not None]
    end = max(ends) if ends else start
    window = end - start
    lat = latencies(recs)
    ok = status["ok"]
    out_tokens = sum(r.output_tokens for r in recs)
    good = _goodput_count(recs, slo) if slo is not None else None
    queue, kv = _timeline_stats(result.timeline, start, end, replicas, num_blocks)
    prompt = sum(r.prompt_tokens for r in recs if r.first_token_s is not None)
    cached = sum(r.cached_tokens for r in recs if r.first_token_s is not None)
    return {
        "requests": len(result.records),
        "measured": len(recs),
        "status": status,
        "window_s": window,
        "request_throughput": ok / window if window > 0 else 0.0,
        "output_token_throughput": out_tokens / window if window > 0 else 0.0,
        "goodput": (good / window if window > 0 else 0.0) if good is not None else None,
        "latency": {k: _pcts(v) for k, v in lat.items()},
        "queue": queue,
        "kv": kv,
        "preemptions": sum(s.preemptions for s in result.stats),
        "prefix_hit_rate": cached / prompt if prompt else 0.0,
        "steps": sum(s.steps for s in result.stats),
        "_values": lat,
    }


def _pcts(values: Sequence[float]) -> dict[str, float | None]:
    d: dict[str, float | None] = {f"p{p}": percentile_or_none(values, p) for p in PERCENTILES}
    d["mean"] = sum(values) / len(values) if values else None
    return d


def _goodput_count(recs: Sequence[Record], slo: Slo) -> int:
    """Finished requests whose own TTFT, TPOT and E2E meet the SLO's targets (the targets
    are percentiles over requests; for one request they are plain bounds)."""
    bounds = {m: s for m, _, s in slo.targets}
    n = 0
    for r in recs:
        if r.status != "ok" or r.first_token_s is None or r.finish_s is None:
            continue
        tt = r.token_times
        got = {"ttft": r.first_token_s - r.arrival_s, "e2e": r.finish_s - r.arrival_s,
               "tpot": (tt[-1] - tt[0]) / (len(tt) - 1) if len(tt) >= 2 else 0.0,
               "itl": max((b - a for a, b in zip(tt, tt[1:], strict=False)), default=0.0)}
        n += all(got[m] <= s for m, s in bounds.items())
    return n


def _timeline_stats(samples: Sequence[Sample], start: float, end: float, replicas: int,
                    num_blocks: int) -> tuple[dict[str, float], dict[str, float]]:
    span = (end - start) * replicas
    q_area = kv_area = 0.0
    q_max = kv_max = 0
    for s in samples:
        # The part of the step inside the window.
        dt = min(s.t + s.dt, end) - max(s.t, start)
        if dt <= 0 and not (s.dt == 0 and start <= s.t <= end):
            continue
        dt = max(dt, 0.0)
        q_area += s.queue * dt
        kv_area += s.used_blocks * dt
        q_max = max(q_max, s.queue)
        kv_max = max(kv_max, s.used_blocks)
    return (
        {"mean": q_area / span if span > 0 else 0.0, "max": q_max},
        {"mean_used_fraction": kv_area / span / num_blocks if span > 0 else 0.0,
         "peak_used_fraction": kv_max / num_blocks, "peak_used_blocks": kv_max},
    )
