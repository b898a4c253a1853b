"""AsyncEngine: the Trio bridge between many request tasks and one synchronous engine.

One loop task is the engine's only writer. Callers never touch the engine: `stream()` and
`generate()` validate at once (so bad input is an error before anything is queued), then put
the request in an inbox; `abort_nowait()` puts an abort there. The loop applies the inbox
only at step boundaries, aborts first in their requests' arrival order, then arrivals in
arrival order, so the sequence of steps depends on the order of events and never on which
Trio task happened to run first. Every request gets its own unbounded channel: the loop hands
over each update with `send_nowait` and never waits for a reader, so a slow reader cannot
slow the batch. A reader that stops (closes its stream, is cancelled, drops it) is a stopped
request: its abort is a synchronous call, because any await in a cancelled `finally` would be
cancelled again (docs/ARCHITECTURE.md, pitfalls).

A model that can be lost between steps (a tensor-parallel rank that dies or goes silent:
`on_lost`, nanoserve.model.base) tells the bridge from its own thread; the news reaches the
loop through the Trio token, `healthy` turns False at once (/health 503 on an idle server
too), and the loop fails everything in flight (a running step fails by itself).

Nothing is lost silently: every request the bridge accepts ends with a final update for each
of its completions, the engine's own (length, stop, abort, a step's error) or one the bridge
writes (aborted before admission, admission failed, the loop failed, the bridge closed);
ledger.py keeps that account.

A `BridgeRecorder` (the recorder hook; `sim.record.recorder` implements it for
`serve --record`) is told, in the loop task, what a trace needs and nothing else: which
requests each boundary aborted and took in, and every update routed to a reader, with the
step count at that point.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio

from nanoserve.bridge.clock import Clock
from nanoserve.bridge.ledger import Entry, Ledger
from nanoserve.bridge.stream import RequestStream
from nanoserve.bridge.types import (
    BridgeRecorder,
    BridgeStats,
    EngineDeadError,
    Prompt,
    StepListener,
)
from nanoserve.engine.admission import Prepared
from nanoserve.engine.engine import Engine
from nanoserve.engine.outputs import OutputBuilder, RequestOutput, StepResult
from nanoserve.engine.request import FinishReason, Update
from nanoserve.sampling.params import SamplingParams

log = logging.getLogger("nanoserve.bridge")  # the name it had before the package split



class AsyncEngine:
    def __init__(
        self, engine: Engine, clock: Clock, recorder: BridgeRecorder | None = None
    ) -> None:
        self._engine = engine
        self._clock = clock
        self._recorder = recorder
        self._ledger = Ledger(self._record_update)
        self._inbox: deque[Entry] = deque()
        self._aborts: set[str] = set()
        self._listeners: list[StepListener] = []
        self._wakeup = trio.Event()  # set by arrivals; reset at the boundary that takes them
        self._went_idle = trio.Event()  # set each time the loop runs out of work
        self._loop_idle = False
        self._dead: str | None = None
        self._lost: str | None = None  # the model's own report that it can run no step
        self._admitted = self._aborted = 0
        # Read only in the loop task between steps: a live step's thread may be mutating the
        # engine while another task asks for statistics.
        self._snapshot = engine.statistics()

    @classmethod
    @asynccontextmanager
    async def open(
        cls, engine: Engine, clock: Clock, recorder: BridgeRecorder | None = None
    ) -> AsyncIterator[AsyncEngine]:
        self = cls(engine, clock, recorder)
        on_lost = getattr(engine.model, "on_lost", None)
        if on_lost is not None:
            token = trio.lowlevel.current_trio_token()

            def lost(reason: str) -> None:  # in the model's thread
                with contextlib.suppress(trio.RunFinishedError):  # nobody left to tell
                    token.run_sync_soon(self._model_lost, reason)

            on_lost(lost)
        body_error: BaseException | None = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._loop)
                try:
                    yield self
                except BaseException as exc:  # re-raised below, not wrapped in a group
                    body_error = exc
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            self._shutdown()
        if body_error is not None:
            raise body_error

    # -- the caller's side -----------------------------------------------------------------

    def prepare(self, prompt: Prompt, params: SamplingParams | None = None) -> Prepared:
        """Tokenize and validate (raises ParamError) without queueing anything."""
        self._check_alive()
        return self._engine.prepare(prompt, params if params is not None else SamplingParams())

    def stream(
        self,
        prompt: Prompt | Prepared,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> RequestStream:
        """Queue a request now and return its updates. Raises here, before any iteration,
        if the request is invalid or the bridge is dead."""
        self._check_alive()
        if isinstance(prompt, Prepared):
            if params is not None:
                raise TypeError("params must be None when the prompt is already Prepared")
            prepared = prompt
        else:
            prepared = self.prepare(prompt, params)
        entry, recv = self._ledger.accept(self._ledger.new_id(request_id), prepared)
        self._inbox.append(entry)
        self._wakeup.set()
        return RequestStream(self.abort_nowait, entry.request_id, prepared.prompt_ids,
                             prepared.params.n, recv)

    async def generate(
        self,
        prompt: Prompt | Prepared,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> RequestOutput:
        """Run one request to its end; cancelling this aborts it at the next boundary."""
        stream = self.stream(prompt, params, request_id)
        builder = OutputBuilder(stream.request_id, stream.prompt_ids, stream.n)
        async with stream:
            async for update in stream:
                builder.add(update)
        return builder.build()

    def abort_nowait(self, request_id: str) -> None:
        """Abort at the next step boundary; a request that has already ended is left alone."""
        if request_id in self._ledger.entries:
            self._aborts.add(request_id)

    def add_step_listener(self, fn: StepListener) -> None:
        """Call fn(result) in the loop task after each step's updates are delivered."""
        self._listeners.append(fn)

    @property
    def healthy(self) -> bool:
        return self._dead is None and self._lost is None

    def statistics(self) -> BridgeStats:
        s = self._snapshot
        return BridgeStats(
            steps=s.steps, queued=len(self._inbox), running=s.running, waiting=s.waiting,
            in_flight=len(self._ledger.entries), num_blocks=s.num_blocks,
            free_blocks=s.free_blocks, admitted=self._admitted,
            completed=self._ledger.completed, aborted=self._aborted,
            failed=self._ledger.failed, preemptions=s.preemptions, healthy=self.healthy,
        )

    async def wait_idle(self) -> None:
        """Return once the loop has run out of work: no arrival queued, no request running."""
        await trio.lowlevel.checkpoint()
        while not (self._loop_idle and not self._inbox):
            self._check_alive()
            await self._went_idle.wait()
        self._check_alive()

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._lost is not None:
            raise EngineDeadError(self._lost)

    def _model_lost(self, reason: str) -> None:
        """In the Trio thread: the model says it can run no further step."""
        if self._lost is None and self._dead is None:
            self._lost = reason
            self._wakeup.set()  # an idle loop fails everything now

    # -- the loop task: the engine's single writer -----------------------------------------

    async def _loop(self) -> None:
        try:
            while True:
                if self._lost is not None:
                    log.error("AsyncEngine: the model was lost after step %d: %s",
                              self._engine.num_steps, self._lost)
                    self._fail_all(f"the model was lost after step {self._engine.num_steps}: "
                                   f"{self._lost}")
                    return
                if not (self._inbox or self._engine.has_unfinished()):
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
        self._loop_idle = True
        self._went_idle.set()
        try:
            await self._wakeup.wait()
        finally:
            self._loop_idle = False
        self._went_idle = trio.Event()

    def _boundary(self) -> None:
        if self._wakeup.is_set():
            self._wakeup = trio.Event()  # this boundary takes every arrival so far
        # Aborts in their requests' arrival order, not the order of the abort calls (which
        # follows task scheduling): freed blocks then return to the pool in a canonical order.
        targets = sorted(
            (e for rid in self._aborts if (e := self._ledger.entries.get(rid)) is not None),
            key=lambda e: e.seq,
        )
        self._aborts.clear()
        for entry in targets:
            self._abort(entry, None)
        if self._recorder is not None:
            self._record(self._recorder.boundary, self._engine.num_steps,
                         [e.request_id for e in targets],
                         [e.request_id for e in self._inbox if not e.ended])
        while self._inbox:
            entry = self._inbox.popleft()
            if entry.ended:  # aborted before it was admitted
                continue
            try:
                self._engine.admit(entry.prepared, entry.request_id)
            except Exception as exc:  # fails this request, not the loop
                self._ledger.end(entry, FinishReason.ERROR, f"admission failed: {exc!r}")
                continue
            entry.admitted = True
            self._admitted += 1
        self._snapshot = self._engine.statistics()

    def _deliver(self, result: StepResult) -> None:
        for update in result.updates:
            self._ledger.route(update)
        if not self._engine.has_unfinished():
            # The engine holds nothing, so every admitted request has ended; one whose final
            # update never came would leave its reader waiting forever.
            for entry in [e for e in self._ledger.entries.values() if e.admitted]:
                self._ledger.end(entry, FinishReason.ERROR,
                                 "the engine dropped the request without a final update")
        self._snapshot = self._engine.statistics()
        for fn in self._listeners:
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
        self._aborted += 1
        if entry.admitted:
            for final in self._engine.abort_request(entry.request_id):
                self._ledger.route(dataclasses.replace(final, error=why))
        self._ledger.end(entry, FinishReason.ABORT, why)  # completions the engine did not end

    def _fail_all(self, reason: str) -> None:
        """The loop is gone: end everything in flight with an error naming why."""
        self._dead = reason
        for entry in self._ledger.in_arrival_order():
            self._ledger.end(entry, FinishReason.ERROR, reason)
        self._inbox.clear()
        self._aborts.clear()
        self._went_idle.set()  # wake wait_idle() callers, who then raise EngineDeadError

    def _shutdown(self) -> None:
        """After the loop has stopped: abort what is in flight so its blocks return."""
        if self._dead is not None:  # the engine failed mid-step: leave its state alone
            return
        for entry in self._ledger.in_arrival_order():
            self._abort(entry, "the engine was shut down")
        self._dead = "the AsyncEngine is closed"
        self._snapshot = self._engine.statistics()
        self._inbox.clear()
        self._went_idle.set()
