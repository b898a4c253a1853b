"""AsyncEngine: the Trio bridge between many request tasks and one synchronous engine.

One loop task is the engine's only writer (loop.py). Callers never touch the engine:
`stream()` and `generate()` validate at once (so bad input is an error before anything is
queued), then put the request in the loop's inbox; `abort_nowait()` puts an abort there. The
loop applies both only at step boundaries, in a canonical order. Every request gets its own
unbounded channel, which the loop never waits on, so a slow reader cannot slow the batch.
A reader that stops (closes its stream, is cancelled, drops it) is a stopped request: its
abort is a synchronous call, because any await in a cancelled `finally` would be cancelled
again (docs/ARCHITECTURE.md, pitfalls).

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
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from nanoserve.bridge.clock import Clock
from nanoserve.bridge.loop import EngineLoop
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
from nanoserve.engine.outputs import OutputBuilder, RequestOutput
from nanoserve.sampling.params import SamplingParams


class AsyncEngine:
    def __init__(
        self, engine: Engine, clock: Clock, recorder: BridgeRecorder | None = None
    ) -> None:
        self._engine = engine
        self._loop = EngineLoop(engine, clock, recorder)
        self._ledger = self._loop.ledger

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
                    token.run_sync_soon(self._loop.model_lost, reason)

            on_lost(lost)
        body_error: BaseException | None = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._loop.run)
                try:
                    yield self
                except BaseException as exc:  # re-raised below, not wrapped in a group
                    body_error = exc
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            self._loop.shutdown()
        if body_error is not None:
            raise body_error

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
        self._loop.submit(entry)
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
        self._loop.abort(request_id)

    def add_step_listener(self, fn: StepListener) -> None:
        """Call fn(result) in the loop task after each step's updates are delivered."""
        self._loop.listeners.append(fn)

    @property
    def healthy(self) -> bool:
        return self._loop.why_dead() is None

    def statistics(self) -> BridgeStats:
        s, loop = self._loop.snapshot, self._loop
        return BridgeStats(
            steps=s.steps, queued=len(loop.inbox), running=s.running, waiting=s.waiting,
            in_flight=len(self._ledger.entries), num_blocks=s.num_blocks,
            free_blocks=s.free_blocks, admitted=loop.admitted,
            completed=self._ledger.completed, aborted=loop.aborted_in_flight,
            failed=self._ledger.failed, preemptions=s.preemptions, healthy=self.healthy,
        )

    async def wait_idle(self) -> None:
        """Return once the loop has run out of work: no arrival queued, no request running."""
        await self._loop.wait_idle(self._check_alive)

    def _check_alive(self) -> None:
        why = self._loop.why_dead()
        if why is not None:
            raise EngineDeadError(why)
