"""One `--slo` grammar for `sim bench` and `sim capacity` (sim/stats.py), read in one place."""

from __future__ import annotations

import re

import pytest

from sim.bench.records import parse_slo as bench_slo
from sim.capacity.summary import parse_slo as capacity_slo
from sim.stats import parse_slo_items


def test_both_commands_read_the_same_items_with_the_same_durations() -> None:
    assert parse_slo_items("ttft_p99=2s, tpot_p90 = 200 ms", ("ttft", "tpot"),
                           percentile=True) == [("ttft", 99.0, 2.0), ("tpot", 90.0, 0.2)]
    assert bench_slo("ttft=2s,e2e=1.5s") == {"ttft": 2.0, "e2e": 1.5}
    assert str(capacity_slo("ttft_p99=2s,itl_p50=.5s")) == "ttft_p99=2000ms,itl_p50=500ms"


@pytest.mark.parametrize(("text", "percentile", "message"), [
    ("ttft=2", False, "--slo ttft: a duration with its unit (2s, 200ms), got '2'"),
    ("ttft_p99=2", True, "--slo ttft: a duration with its unit (2s, 200ms), got '2'"),
    ("ttft_p99=2s", False, "--slo takes METRIC=DURATION items"),
    ("ttft=2s", True, "--slo takes METRIC_pNN=DURATION items"),
    ("ttft_p0=2s", True, "--slo percentile must be in (0, 100]"),
    ("speed_p99=2s", True, "--slo takes METRIC_pNN=DURATION items"),
])
def test_a_bad_item_is_named_the_same_way_by_either(text: str, percentile: bool,
                                                    message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        parse_slo_items(text, ("ttft", "tpot"), percentile=percentile)
