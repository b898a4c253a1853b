"""Offload's process-wide settings while request work is in flight (server/offload.py):
the GIL's switch interval lowered and full collections held back, both put back as found
when the last work leaves, and collections given back after MAX_HOLD_S where work never
stops coming. The clock is a fake: the hold's bound is read, never waited for."""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Iterator
from functools import partial

import pytest
import trio

from nanoserve.server import offload
from nanoserve.server.offload import NO_FULL_COLLECTION, _Busy


@pytest.fixture
def now(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    clock = [100.0]
    monkeypatch.setattr(offload.time, "monotonic", lambda: clock[0])
    interval, thresholds = sys.getswitchinterval(), gc.get_threshold()
    sys.setswitchinterval(0.005)
    gc.set_threshold(700, 10, 10)
    yield clock
    assert _Busy.in_flight == 0
    sys.setswitchinterval(interval)
    gc.set_threshold(*thresholds)


def test_the_last_out_puts_back_what_the_first_in_found(now: list[float]) -> None:
    _Busy.enter()
    _Busy.enter()
    assert gc.get_threshold() == (700, 10, NO_FULL_COLLECTION)
    assert sys.getswitchinterval() == pytest.approx(offload.BUSY_SWITCH_INTERVAL_S)
    _Busy.leave()
    assert gc.get_threshold() == (700, 10, NO_FULL_COLLECTION)  # one still in flight
    _Busy.leave()
    assert gc.get_threshold() == (700, 10, 10)
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_collections_resume_after_the_hold_where_work_never_stops(now: list[float]) -> None:
    _Busy.enter()
    for _ in range(3):  # work overlapping work, never none in flight
        _Busy.enter()
        now[0] += offload.MAX_HOLD_S / 2
        _Busy.leave()
    # 1.5 holds since the first came in: the first leave after the bound gave them back.
    assert gc.get_threshold() == (700, 10, 10)
    assert sys.getswitchinterval() == pytest.approx(offload.BUSY_SWITCH_INTERVAL_S)
    _Busy.enter()  # more work while some is in flight does not hold them again
    assert gc.get_threshold() == (700, 10, 10)
    _Busy.leave()
    _Busy.leave()
    assert sys.getswitchinterval() == pytest.approx(0.005)
    _Busy.enter()  # after a moment with none in flight, the next one holds them again
    assert gc.get_threshold() == (700, 10, NO_FULL_COLLECTION)
    _Busy.leave()


def test_a_small_body_s_work_runs_on_the_loop_and_a_large_one_s_in_a_thread(
        now: list[float]) -> None:
    seen: list[tuple[int, int, float]] = []  # (body bytes, thread, switch interval) in fn

    def work(size: int) -> int:
        seen.append((size, threading.get_ident(), sys.getswitchinterval()))
        return size

    async def main() -> int:
        pool = offload.Offload(2)
        for size in (0, offload.INLINE_BYTES - 1, offload.INLINE_BYTES, 1 << 20):
            assert await pool.run(partial(work, size), size) == size
        inline = offload.Offload(None)  # a replay's clocks: inline at any size
        assert await inline.run(partial(work, -1), 1 << 20) == -1
        return threading.get_ident()

    loop = trio.run(main)
    where = [(size, thread == loop) for size, thread, _ in seen]
    assert where == [(0, True), (offload.INLINE_BYTES - 1, True),
                     (offload.INLINE_BYTES, False), (1 << 20, False), (-1, True)]
    # Only the threaded work lowered the switch interval, and it is back as found.
    assert [interval == 0.005 for _, _, interval in seen] == [True, True, False, False, True]
    assert sys.getswitchinterval() == pytest.approx(0.005)
