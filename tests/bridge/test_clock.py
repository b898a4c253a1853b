"""The clocks on their own: tickets, quiescence, virtual cost, the live thread."""

from __future__ import annotations

import threading

import pytest
import trio
import trio.testing

from nanoserve.bridge.clock import GateClock, LiveClock, StepClock, VirtualClock
from nanoserve.engine.outputs import StepResult


def result(step: int = 1) -> StepResult:
    return StepResult(step, (), (), 0, 0)


async def test_gate_counts_tickets_handed_before_the_wait() -> None:
    gate = GateClock()
    gate.release(2)
    assert gate.tickets == 2
    await gate.wait_turn()
    await gate.wait_turn()
    assert gate.tickets == 0
    assert (await gate.run_step(result)).step == 1
    assert gate.steps_run == 1


async def test_gate_blocks_without_a_ticket() -> None:
    gate = GateClock()
    passed: list[int] = []

    async def turn() -> None:
        await gate.wait_turn()
        passed.append(1)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(turn)
        await trio.testing.wait_all_tasks_blocked()
        assert passed == []
        gate.release()
        await trio.testing.wait_all_tasks_blocked()
        assert passed == [1]


@pytest.mark.parametrize("n", [-1, 1.5, True])
def test_gate_release_refuses_bad_counts(n: object) -> None:
    with pytest.raises(ValueError, match="n must be an integer >= 0"):
        GateClock().release(n)  # type: ignore[arg-type]


async def test_step_clock_waits_until_every_other_task_is_blocked() -> None:
    progress: list[int] = []
    parked = trio.Event()

    async def busy() -> None:
        for i in range(5):
            progress.append(i)
            await trio.lowlevel.checkpoint()
        await parked.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(busy)
        await StepClock().wait_turn()
        # Every reaction the other task had to make happened before the boundary.
        assert progress == [0, 1, 2, 3, 4]
        assert (await StepClock().run_step(result)).step == 1
        parked.set()


async def test_virtual_clock_sleeps_the_modelled_cost(
    autojump_clock: trio.testing.MockClock,
) -> None:
    clock = VirtualClock(lambda r: 0.25 * r.step)
    t0 = trio.current_time()
    await clock.wait_turn()
    assert trio.current_time() == t0  # quiescence does not move virtual time
    await clock.run_step(lambda: result(2))
    assert trio.current_time() - t0 == pytest.approx(0.5)


async def test_virtual_clock_finishes_a_started_step_when_cancelled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    clock = VirtualClock(lambda r: 3.0)
    t0 = trio.current_time()
    with trio.CancelScope() as scope:
        scope.cancel()
        got = await clock.run_step(result)  # the step has run: its cost is paid, not lost
        assert got.step == 1
        await trio.lowlevel.checkpoint()  # the cancellation lands at the next checkpoint
        pytest.fail("not cancelled")
    assert trio.current_time() - t0 == pytest.approx(3.0)


@pytest.mark.parametrize("cost", [-1.0, float("nan"), float("inf")])
async def test_virtual_clock_refuses_a_bad_cost(cost: float) -> None:
    with pytest.raises(ValueError, match="step cost must be finite seconds >= 0"):
        await VirtualClock(lambda r: cost).run_step(result)


async def test_live_clock_runs_the_step_in_a_worker_thread() -> None:
    loop_thread = threading.get_ident()
    seen: list[int] = []

    def step() -> StepResult:
        seen.append(threading.get_ident())
        return result()

    clock = LiveClock()
    await clock.wait_turn()
    assert (await clock.run_step(step)).step == 1
    assert len(seen) == 1
    assert seen[0] != loop_thread
