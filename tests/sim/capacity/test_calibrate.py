"""sim/capacity/calibrate.py: the machine's speed against a cost model, from the profile's own grid
code; timings are injected (a step "takes" a known time), never measured."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nanoserve.model.stub import StubModel
from nanoserve.tokenizer import Tokenizer
from sim.capacity.calibrate import CHECK_GRID, geometric_mean, machine_speed, scaled, steal_seconds
from sim.capacity.cost import CostModel


def ticking(step_s: float) -> object:
    """A timer under which every timed step lasts `step_s`."""
    t = [0.0]

    def timer() -> float:
        t[0] += step_s  # a step is timed as the difference of two consecutive reads
        return t[0]

    return timer


def test_speed_is_measured_over_priced_on_the_check_grid(tok: Tokenizer) -> None:
    flat = CostModel((0.25,) + (0,) * 9)  # every step 250 ms
    assert machine_speed(StubModel(tok), tok, flat, reps=1,
                         timer=ticking(0.5)) == pytest.approx(2.0)  # type: ignore[arg-type]
    # Priced by what each measured step computed: a model that charges per decode row sees
    # the 1-row and 8-row points at different ratios and takes their geometric mean.
    rows = CostModel((0, 0, 0, 0.1) + (0,) * 6)
    speed = machine_speed(StubModel(tok), tok, rows, reps=1,
                          timer=ticking(0.4))  # type: ignore[arg-type]
    assert CHECK_GRID["decode"] == (1, 8)
    assert len(CHECK_GRID["prefill"]) == 2
    assert speed == pytest.approx(geometric_mean([4.0, 4.0, 0.5, 0.5]))


def test_speed_is_taken_against_the_profiles_own_sample_of_a_step_where_kept(
    tok: Tokenizer,
) -> None:
    # The fit prices every step at 250 ms, but the profile measured the 8-row steps at
    # 400 ms: today's 400 ms is "as fast as then" for those, 1.6x slow for the 1-row ones
    # (no sample kept: priced by the fit).
    samples = [{"decode": 8, "context": c, "prefill": p, "seconds": 0.4}
               for c in CHECK_GRID["context"] for p in CHECK_GRID["prefill"]]
    cost = CostModel((0.25,) + (0,) * 9, fit={"samples": samples})
    speed = machine_speed(StubModel(tok), tok, cost, reps=1,
                          timer=ticking(0.4))  # type: ignore[arg-type]
    assert speed == pytest.approx(geometric_mean([1.6, 1.6, 1.0, 1.0]))


def test_scaled_prices_every_step_by_the_factor() -> None:
    cost = CostModel((0.02, 1e-4, 3e-3, 2e-3, 4e-6, 2e-8, 5e-3, 1e-4, 0.0, 0.0), name="m.json")
    x = (1.0, 96.0, 1.0, 8.0, 2000.0, 4656.0, 1.0, 104.0, 0.0, 0.0)
    slow = scaled(cost, 1.25)
    assert slow.predict(x) == pytest.approx(1.25 * cost.predict(x))
    assert slow.name == "m.json x1.250"


def test_steal_is_the_eighth_counter_of_the_cpu_line(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice, in clock ticks
    stat.write_text("cpu  3535376 509123 151200 6197639 7217 0 7855 321132 0 0\n"
                    "cpu0 1 2 3 4 5 6 7 8 0 0\n")
    assert steal_seconds(stat) == 321132 / os.sysconf("SC_CLK_TCK")
    stat.write_text("intr 1 2 3\n")  # not a Linux /proc/stat: unknown, not zero
    assert steal_seconds(stat) is None
    assert steal_seconds(tmp_path / "missing") is None
