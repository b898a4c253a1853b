"""Clocks: how one engine step maps to seconds, and when the next step may begin.

The engine counts time in steps (docs/ARCHITECTURE.md, "The bridge and the clocks"); a clock
decides two things for the bridge's loop task. `wait_turn()` returns when the next step
boundary may be taken: the loop applies every arrival and abort that landed before it
returns, then calls `run_step()`, which runs `Engine.step()` and returns its result once the
step is over in that clock's notion of time. Updates are delivered only after `run_step()`
returns, so a reader sees a step's tokens when the step has ended: after the thread (live),
at once (step), after the modelled cost (virtual), or when the test hands over a ticket
(gate).

Why the step and virtual clocks wait for quiescence at the boundary: a reader that reacts to
step k (a client that hangs up after two frames) is a task of its own, and Trio runs ready
tasks in a random order (docs/ARCHITECTURE.md, pitfalls). If the loop took the boundary as
soon as it could, the hang-up would land before step k+1 in some runs and after it in
others. Waiting until every other task is blocked (`trio.testing.wait_all_tasks_blocked`)
places every reaction to step k before boundary k+1 in every run, so a replay is a pure
function of its trace. Under `MockClock(autojump_threshold=0)` that wait wakes without
moving virtual time. The catch for tests: waiters with equal cushions all wake together, so
a test that calls `wait_all_tasks_blocked()` while such a loop has work learns that every
task was blocked, not whether the loop has stepped since; `AsyncEngine.wait_idle()` says
that. The gate clock has no such wait: its tickets are the synchronisation, and tests drive
it with `wait_all_tasks_blocked()` freely.

Only the live clock uses a thread and real seconds; nothing here reads the wall clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import trio
import trio.testing

if TYPE_CHECKING:
    # Types only: the clocks sit with the bridge, above the engine, and never call into it.
    from nanoserve.engine.outputs import StepResult

Step = Callable[[], "StepResult"]


class Clock(Protocol):
    async def wait_turn(self) -> None:
        """Return when the next step boundary may be taken. Must checkpoint."""
        ...

    async def run_step(self, step: Step) -> StepResult:
        """Run one step; return its result once the step has ended in this clock's time."""
        ...


class LiveClock:
    """Real time: the step runs in a worker thread so the event loop keeps serving sockets
    while the model computes. The thread cannot be abandoned on cancellation: a step, once
    started, finishes, and the bridge delivers what it produced before it stops."""

    async def wait_turn(self) -> None:
        await trio.lowlevel.checkpoint()

    async def run_step(self, step: Step) -> StepResult:
        return await trio.to_thread.run_sync(step)


class StepClock:
    """Pure step time: the step runs inline, seconds never advance (exact replay)."""

    async def wait_turn(self) -> None:
        await trio.testing.wait_all_tasks_blocked()

    async def run_step(self, step: Step) -> StepResult:
        return step()


class VirtualClock:
    """Modelled time, for `trio.testing.MockClock(autojump_threshold=0)`: the step runs
    inline, then the loop sleeps `cost(result)` virtual seconds. A thread here would let the
    autojump clock leap ahead while the step ran, so there is none."""

    def __init__(self, cost: Callable[[StepResult], float]) -> None:
        self.cost = cost

    async def wait_turn(self) -> None:
        await trio.testing.wait_all_tasks_blocked()

    async def run_step(self, step: Step) -> StepResult:
        result = step()
        seconds = self.cost(result)
        if not (isinstance(seconds, int | float) and math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"step cost must be finite seconds >= 0, got {seconds!r}")
        # Shielded for the same reason the live clock's thread is not abandoned: the step
        # has already changed the engine, so its updates must be delivered, even on shutdown.
        with trio.CancelScope(shield=True):
            await trio.sleep(seconds)
        return result


class GateClock:
    """For tests: the loop takes one step boundary per ticket the test hands it.

    `release(n)` is synchronous and may come before the loop waits; tickets accumulate. A
    ticket is spent at the boundary, so if that boundary leaves no work (every request
    aborted), no step follows it. `steps_run` counts the steps actually run."""

    def __init__(self) -> None:
        self._tickets = trio.Semaphore(0)
        self.steps_run = 0

    def release(self, n: int = 1) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an integer >= 0, got {n!r}")
        for _ in range(n):
            self._tickets.release()

    @property
    def tickets(self) -> int:
        """Tickets handed over and not yet spent."""
        return self._tickets.value

    async def wait_turn(self) -> None:
        await self._tickets.acquire()

    async def run_step(self, step: Step) -> StepResult:
        self.steps_run += 1
        return step()
