"""Statistics sim's reports share: percentiles, durations with their unit, and the one
grammar of `--slo` (`sim bench`'s per-request thresholds and `sim capacity`'s percentile
targets are both `metric[_pNN]=DURATION` items, read here).

`sim bench` (a client's measurements) and `sim capacity` (the simulator's) summarise
latencies the same way, so a figure means the same in both reports.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

PERCENTILES = (50, 90, 99)
_DURATION = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(ms|s)\s*")


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100) of `values`, linear between order statistics (numpy's
    default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= p <= 100:
        raise ValueError(f"p must be in [0, 100], got {p}")
    xs = sorted(values)
    rank = p / 100 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def percentile_or_none(values: Sequence[float], p: float) -> float | None:
    """`percentile`, or None for no values (a report's empty cell)."""
    return percentile(values, p) if values else None


def parse_duration(text: str) -> float | None:
    """`2s` or `200ms` (spaces allowed) in seconds; None unless the unit is given: a bare
    200 could be either, and a wrong guess would pass or fail everything."""
    m = _DURATION.fullmatch(text)
    return None if m is None else float(m.group(1)) * (0.001 if m.group(2) == "ms" else 1.0)


_SLO_ITEM = re.compile(r"\s*([a-z0-9]+?)(?:_p(\d+(?:\.\d+)?))?\s*=(.*)")


def parse_slo_items(text: str, metrics: Sequence[str], *, percentile: bool
                    ) -> list[tuple[str, float | None, float]]:
    """`ttft_p99=2s,tpot_p99=200ms` (percentile=True: each item names its percentile) or
    `ttft=2s,tpot=200ms` (False: a threshold per request) -> [(metric, p or None,
    seconds)]. Every duration needs its unit: a bare 200 could be either, and a wrong guess
    would pass or fail everything."""
    shape = "METRIC_pNN=DURATION" if percentile else "METRIC=DURATION"
    out: list[tuple[str, float | None, float]] = []
    for item in text.split(","):
        if not item.strip():
            continue
        m = _SLO_ITEM.fullmatch(item)
        if m is None or m.group(1) not in metrics or (m.group(2) is None) == percentile:
            raise ValueError(f"--slo takes {shape} items ({'|'.join(metrics)}, e.g. "
                             f"{metrics[0]}{'_p99' if percentile else ''}=2s), got {item!r}")
        p = float(m.group(2)) if m.group(2) is not None else None
        if p is not None and not 0 < p <= 100:
            raise ValueError(f"--slo percentile must be in (0, 100], got {item!r}")
        seconds = parse_duration(m.group(3))
        if seconds is None:
            raise ValueError(f"--slo {m.group(1)}: a duration with its unit (2s, 200ms), "
                             f"got {m.group(3).strip()!r}")
        if seconds <= 0:  # no request is served in no time: a target nothing can meet
            raise ValueError(f"--slo {m.group(1)}: must be a duration > 0, got "
                             f"{m.group(3).strip()!r}")
        out.append((m.group(1), p, seconds))
    return out
