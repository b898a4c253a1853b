"""EngineLoop: the loop task, the engine's only writer (the other half of async_engine.py).

Callers reach it through `AsyncEngine`, which puts accepted requests in the inbox (`submit`)
and aborts in a set (`abort`); the loop applies both only at step boundaries, aborts first
in their requests' arrival order, then arrivals in arrival order, so the sequence of steps
depends on the order of events and never on which Trio task happened to run first. It hands
over each update with `send_nowait` through the ledger and never waits for a reader, so a
slow reader cannot slow the batch.

A model lost between steps (`model_lost`, from the Trio thread) makes the loop fail
everything in flight and stop; a failing loop does the same. Either way the bridge is dead:
`why_dead` says why, and every caller gets EngineDeadError from then on.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

import trio

from nanoserve.bridge.clock import Clock
from nanoserve.bridge.ledger import Entry, Ledger
from nanoserve.bridge.types import BridgeRecorder, StepListener
from nanoserve.engine.engine import Engine
from nanoserve.engine.outputs import EngineStats, StepResult
from nanoserve.engine.request import FinishReason, Update

log = logging.getLogger("nanoserve.bridge")


class EngineLoop:
    def __init__(
        self, engine: Engine, clock: Clock, recorder: BridgeRecorder | None = None
    ) -> None:
        self._engine = engine
        self._clock = clock
        self._recorder = recorder
        self.ledger = Ledger(self._record_update)
        self.inbox: deque[Entry] = deque()  # accepted, for the next boundary to take
        self._aborts: set[str] = set()
        self.listeners: list[StepListener] = []
        self._wakeup = trio.Event()  # set by arrivals; reset at the boundary that takes them
        self._went_idle = trio.Event()  # set each time the loop runs out of work
        self._idle_now = False
        self._dead: str | None = None
        self._lost: str | None = None  # the model's own report that it can run no step
        self.admitted = 0
        # Requests in flight that the loop aborted (at a boundary, or at shutdown), queued
        # or admitted: the engine counts only the admitted ones it ended (EngineStats.aborted).
        self.aborted_in_flight = 0
        # Read only in the loop task between steps: a live step's thread may be mutating the
        # engine while another task asks for statistics.
        self.snapshot: EngineStats = engine.statistics()

    # -- asked by the caller's side (AsyncEngine) ------------------------------------------

    def submit(self, entry: Entry) -> None:
        self.inbox.append(entry)
        self._wakeup.set()

    def abort(self, request_id: str) -> None:
        """Abort at the next boundary; a request that has already ended is left alone."""
        if request_id in self.ledger.entries:
            self._aborts.add(request_id)

    def why_dead(self) -> str | None:
        """Why the bridge takes no more requests, or None while it does."""
        return self._dead if self._dead is not None else self._lost

    def model_lost(self, reason: str) -> None:
        """In the Trio thread: the model says it can run no further step."""
        if self._lost is None and self._dead is None:
            self._lost = reason
            self._wakeup.set()  # an idle loop fails everything now

    async def wait_idle(self, check_alive: Callable[[], None]) -> None:
        """Return once the loop has run out of work: no arrival queued, no request running."""
        await trio.lowlevel.checkpoint()
        while not (self._idle_now and not self.inbox):
            check_alive()
            await self._went_idle.wait()
        check_alive()

    # -- the loop task ---------------------------------------------------------------------

    async def run(self) -> None:
        try:
            while True:
                if self._lost is not None:
                    log.error("AsyncEngine: the model was lost after step %d: %s",
                              self._engine.num_steps, self._lost)
                    self._fail_all(f"the model was lost after step {self._engine.num_steps}: "
                                   f"{self._lost}")
                    return
                if not (self.inbox or self._engine.has_unfinished()):
                    await self._idle()
                    continue
                await self._clock.wait_turn()
                self._boundary()
                if self._engine.has_unfinished():  # the boundary may have aborted everything
                    self._deliver(await self._clock.run_step(self._engine.step))
        except Exception as exc:  # Cancelled is a BaseException and passes through
            log.exception("AsyncEngine loop failed")
            self._fail_all(f"engine loop failed after step {self._engine.num_steps}: {exc!r}")

    async def _idle(self) -> None:
        self._aborts.clear()  # with nothing queued or running, every abort target has ended
        self._idle_now = True
        self._went_idle.set()
        try:
            await self._wakeup.wait()
        finally:
            self._idle_now = False
        self._went_idle = trio.Event()

    def _boundary(self) -> None:
        if self._wakeup.is_set():
            self._wakeup = trio.Event()  # this boundary takes every arrival so far
        # Aborts in their requests' arrival order, not the order of the abort calls (which
        # follows task scheduling): freed blocks then return to the pool in a canonical order.
        targets = sorted(
            (e for rid in self._aborts if (e := self.ledger.entries.get(rid)) is not None),
            key=lambda e: e.seq,
        )
        self._aborts.clear()
        for entry in targets:
            self._abort(entry, None)
        if self._recorder is not None:
            self._record(self._recorder.boundary, self._engine.num_steps,
                         [e.request_id for e in targets],
                         [e.request_id for e in self.inbox if not e.ended])
        while self.inbox:
            entry = self.inbox.popleft()
            if entry.ended:  # aborted before it was admitted
                continue
            try:
                self._engine.admit(entry.prepared, entry.request_id)
            except Exception as exc:  # fails this request, not the loop
                self.ledger.end(entry, FinishReason.ERROR, f"admission failed: {exc!r}")
                continue
            entry.admitted = True
            self.admitted += 1
        self.snapshot = self._engine.statistics()

    def _deliver(self, result: StepResult) -> None:
        for update in result.updates:
            self.ledger.route(update)
        if not self._engine.has_unfinished():
            # The engine holds nothing, so every admitted request has ended; one whose final
            # update never came would leave its reader waiting forever.
            for entry in [e for e in self.ledger.entries.values() if e.admitted]:
                self.ledger.end(entry, FinishReason.ERROR,
                                "the engine dropped the request without a final update")
        self.snapshot = self._engine.statistics()
        for fn in self.listeners:
            try:
                fn(result)
            except Exception:  # a metrics bug must not stop serving
                log.exception("step listener %r failed", fn)

    def _record(self, fn: Callable[..., None], *args: object) -> None:
        try:
            fn(*args)
        except Exception:  # a recorder bug must not stop serving
            log.exception("recorder %r failed", fn)

    def _record_update(self, update: Update) -> None:
        if self._recorder is not None:
            self._record(self._recorder.update, self._engine.num_steps, update)

    def _abort(self, entry: Entry, why: str | None) -> None:
        self.aborted_in_flight += 1
        if entry.admitted:
            for final in self._engine.abort_request(entry.request_id):
                self.ledger.route(final._replace(error=why))
        self.ledger.end(entry, FinishReason.ABORT, why)  # completions the engine did not end

    def _fail_all(self, reason: str) -> None:
        """The loop is gone: end everything in flight with an error naming why."""
        self._dead = reason
        for entry in self.ledger.in_arrival_order():
            self.ledger.end(entry, FinishReason.ERROR, reason)
        self.inbox.clear()
        self._aborts.clear()
        self._went_idle.set()  # wake wait_idle() callers, who then raise EngineDeadError

    def shutdown(self) -> None:
        """After the loop has stopped: abort what is in flight so its blocks return."""
        if self._dead is not None:  # the engine failed mid-step: leave its state alone
            return
        for entry in self.ledger.in_arrival_order():
            self._abort(entry, "the engine was shut down")
        self._dead = "the AsyncEngine is closed"
        self.snapshot = self._engine.statistics()
        self.inbox.clear()
        self._went_idle.set()
