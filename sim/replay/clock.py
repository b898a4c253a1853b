"""The bridge's clock in a replay: a step boundary only when the driver opens one.

`ReplayClock` is nanoserve's `Clock` (nanoserve/bridge/clock.py) for `sim replay`: the bridge's
loop waits in `wait_turn()` for a ticket, which the driver hands over with `open_boundary()`
once every task has reacted to the last step and the due arrivals have reached the inbox;
`run_step()` runs the step inline and, under the virtual clock, then sleeps its modelled cost.
It is apart from the driver because it is the one piece the bridge calls: the driver decides
when a boundary opens, the clock holds the loop until then and says when the step is over
(`step_over()`).
"""

from __future__ import annotations

import math

import trio

from nanoserve.bridge.clock import Step
from nanoserve.engine.outputs import StepResult
from sim.replay.setup import CostFn


class ReplayClock:
    """The bridge's clock in a replay: one boundary per `open_boundary()`; with a cost model
    the step then lasts `cost(result)` virtual seconds."""

    def __init__(self, cost: CostFn | None) -> None:
        self._cost = cost
        self._tickets = trio.Semaphore(0)
        self._over = trio.Event()
        self.stepping = False

    @property
    def tickets(self) -> int:
        return self._tickets.value

    def open_boundary(self) -> None:
        self._tickets.release()

    async def wait_turn(self) -> None:
        await self._tickets.acquire()

    async def run_step(self, step: Step) -> StepResult:
        self.stepping, self._over = True, trio.Event()
        try:
            result = step()
            if self._cost is not None:
                seconds = self._cost(result)
                if not (isinstance(seconds, int | float) and math.isfinite(seconds)
                        and seconds >= 0):
                    raise ValueError(f"step cost must be finite seconds >= 0, got {seconds!r}")
                with trio.CancelScope(shield=True):  # the step happened: deliver it
                    await trio.sleep(seconds)
            return result
        finally:
            self.stepping = False
            self._over.set()

    async def step_over(self) -> None:
        if self.stepping:
            await self._over.wait()

