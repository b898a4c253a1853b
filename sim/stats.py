"""Statistics sim's reports share: percentiles and durations with their unit.

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
