"""How fast this machine runs the model now, beside when its cost model was profiled.

A shared host does not keep one speed: on this project's 2-core guests the same step has
measured 25% slower from one hour to the next (other guests' memory traffic, and the
hypervisor's steal time, which a guest's wall clock sees and its CPU clock does not).
`sim validate` compares the simulator with wall-clock runs; a comparison that did not know
the machine's speed at the time would mix the cost model's error with the host's drift.

So validate re-measures a few of the profile's own grid points, with the profile's own code
(`measure_grid`), before each run and after the last: the machine's speed is their measured
time over the time the profile measured for the very same steps (a geometric mean, so 1.0
means "as fast as when profiled"). It prints that, the host's steal time during the runs, and a
second prediction from the cost model scaled by the speed: the first column tests the cost
model as saved, the second the simulator and the cost model's shape on today's machine.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from nanoserve.model.base import Model
from nanoserve.tokenizer import Tokenizer
from sim.capacity.cost import CostModel
from sim.capacity.profile import measure_grid

# One decode row (the gemv) and eight (a packed gemm), each alone and beside a 96-token
# prompt: the regimes a light and a saturated load are made of, a few seconds in all.
CHECK_GRID = {"decode": (1, 8), "context": (32,), "prefill": (0, 96)}


def machine_speed(model: Model, tokenizer: Tokenizer, cost: CostModel, *, reps: int = 3,
                  timer: Callable[[], float] = time.perf_counter) -> float:
    """Measured step time on CHECK_GRID over the same step's time when `cost` was profiled:
    > 1 when slower than profiled. The profile's own sample of the step is the reference
    where the cost file keeps it (format 4 does), its fitted price otherwise: the fit prices
    the four check steps 2-10% under the profile's samples of them (measured), and a speed
    taken against the fit carried that residual into every prediction scaled by it."""
    points = measure_grid(model, tokenizer, CHECK_GRID, reps=reps, timer=timer)
    recorded = {(s["decode"], s["context"], s["prefill"]): float(s["seconds"])
                for s in cost.fit.get("samples", ())}
    ratios = [p.seconds / (recorded.get((p.decode, p.context, p.prefill))
                           or cost.predict(p.features)) for p in points]
    if not all(r > 0 and math.isfinite(r) for r in ratios):
        raise ValueError("the cost model prices a calibration step at 0 s")
    return geometric_mean(ratios)


def geometric_mean(xs: Sequence[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def scaled(cost: CostModel, factor: float) -> CostModel:
    """`cost` with every step `factor` times as long, named so a report says so."""
    return replace(cost, coef=tuple(c * factor for c in cost.coef),
                   name=f"{cost.name} x{factor:.3f}")


def steal_seconds(stat: str | os.PathLike[str] = "/proc/stat") -> float | None:
    """CPU seconds the hypervisor has taken from this guest since boot, summed over its
    CPUs (the `steal` column of /proc/stat's first line); None where the kernel does not
    say."""
    try:
        with open(stat, encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    return int(fields[8]) / os.sysconf("SC_CLK_TCK")
