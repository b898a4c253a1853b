"""Requests in flight at the HTTP layer: one `Job` per HTTP request, and their registry.

A completions request may carry several prompts, each its own engine request with its own
`RequestStream`; the handler wants them as one sequence of updates. Trio has no `select`,
so each stream gets a small pump task that forwards its updates into the job's unbounded
channel (docs/ARCHITECTURE.md: per-request queues are unbounded, a slow reader never slows a batch).
The pumps live in the app's nursery because a streaming response outlives its handler.

Ending a job is synchronous (`Job.close`): a hang-up reaches the response generator as
`trio.Cancelled` or `GeneratorExit`, and any await in that `finally` would be cancelled
again (docs/ARCHITECTURE.md, pitfalls). `close` therefore closes each `RequestStream` (its
abort is a `*_nowait` call into the bridge, taken at the next step boundary) and cancels the
pumps.

The registry answers the questions the server asks about everything in flight: is the
queue full (429), is this request id already taken, and, on shutdown, what is left to end.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import trio

from nanoserve.bridge import AsyncEngine, RequestStream
from nanoserve.engine.admission import Prepared
from nanoserve.engine.request import Endings, Update, check_unused
from nanoserve.sampling.params import ParamError
from nanoserve.server.errors import ApiError, from_param_error
from nanoserve.server.metrics import Metrics

log = logging.getLogger("nanoserve.server")


@dataclass(frozen=True, slots=True)
class Ended:
    """The job was ended from outside (server shutdown) or its pump failed."""

    status: int
    message: str
    code: str


Item = tuple[int, Update] | Ended  # (prompt number, update) or the end


class Job:
    """One HTTP request's engine requests, merged into one channel of updates."""

    def __init__(
        self, registry: Registry, public_id: str, prepared: Sequence[Prepared], arrival: float
    ) -> None:
        self.id = public_id
        self.n = prepared[0].params.n
        # Usage is the engine's count: the prompts admission prepared, and each
        # completion's num_output_tokens from its latest update, keyed (prompt, index).
        self.num_prompt_tokens = sum(len(p.prompt_ids) for p in prepared)
        self._outputs: dict[tuple[int, int], int] = {}
        self._registry = registry
        self._metrics = registry.metrics
        self._arrival = arrival
        self._send, self._recv = trio.open_memory_channel[Item](math.inf)
        self._streams: list[RequestStream] = []
        self._scopes: list[trio.CancelScope] = []
        self._endings = [Endings(self.n) for _ in prepared]  # per prompt, as consumed
        self._first_seen: set[int] = set()  # prompts whose first token has arrived
        self._last_token: dict[tuple[int, int], float] = {}
        self._reasons: list[str] = []
        self._closed = False
        ids = [public_id] if len(prepared) == 1 else [f"{public_id}-{k}"
                                                       for k in range(len(prepared))]
        try:
            for rid, prep in zip(ids, prepared, strict=True):
                self._streams.append(registry.bridge.stream(prep, request_id=rid))
                self._metrics.arrived(rid, arrival)
        except BaseException:
            self.close()
            raise

    @property
    def done(self) -> bool:
        return all(e.all for e in self._endings)

    @property
    def num_output_tokens(self) -> int:
        """The tokens the engine generated for this job's completions so far."""
        return sum(self._outputs.values())

    @property
    def request_ids(self) -> list[str]:
        """The engine request ids, one per prompt, in the order they were queued."""
        return [s.request_id for s in self._streams]

    def start(self, nursery: trio.Nursery) -> None:
        for k, stream in enumerate(self._streams):
            scope = trio.CancelScope()
            self._scopes.append(scope)
            nursery.start_soon(self._pump, k, stream, scope)

    async def _pump(self, k: int, stream: RequestStream, scope: trio.CancelScope) -> None:
        with scope, contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError):
            try:
                async for update in stream:
                    self._send.send_nowait((k, update))
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                raise  # the job closed its end: nothing to report to anyone
            except Exception as exc:  # a bridge failure ends this job, not the server
                log.exception("%s: stream %d failed", self.id, k)
                self._send.send_nowait(Ended(500, f"the engine failed: {exc!r}", "engine_error"))

    async def next(self) -> Item:
        """The next update (or the end); call only while `not done`."""
        item = await self._recv.receive()
        if isinstance(item, Ended):
            return item
        k, u = item
        now = trio.current_time()
        if u.new_token_ids:
            if k not in self._first_seen:
                self._first_seen.add(k)
                self._metrics.first_token(now - self._arrival)
            self._metrics.tokens(len(u.new_token_ids))
            last = self._last_token.get((k, u.index))
            if last is not None:
                self._metrics.inter_token(now - last)
            self._last_token[(k, u.index)] = now
        # Never lowered: an ending the bridge makes (shutdown, the loop gone) carries 0.
        key = (k, u.index)
        self._outputs[key] = max(self._outputs.get(key, 0), u.num_output_tokens)
        if self._endings[k].note(u):
            self._reasons.append(u.finish_reason or "unknown")
        return item

    def end(self, status: int, message: str, code: str) -> None:
        """End from outside (shutdown): the reader sees `Ended` next and answers with it."""
        with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError):
            self._send.send_nowait(Ended(status, message, code))

    def close(self) -> None:
        """Stop everything this job started; synchronous and idempotent (see module doc)."""
        if self._closed:
            return
        self._closed = True
        for stream in self._streams:
            stream.close()  # aborts at the next boundary unless it already ended
            self._metrics.forget(stream.request_id)
        for scope in self._scopes:
            scope.cancel()
        self._recv.close()
        # Completions still open as the job closes: the client hung up, or shutdown cut them.
        cut_short = sum(e.open for e in self._endings)
        if self._scopes:  # it started: count it (a job whose admission failed never ran)
            self._metrics.finished(self._reasons + ["abort"] * cut_short,
                                   self.num_prompt_tokens, trio.current_time() - self._arrival)
        self._registry.remove(self)
        log.info("%s: done: prompt_tokens=%d completion_tokens=%d finish=%s%s", self.id,
                 self.num_prompt_tokens, self.num_output_tokens, ",".join(self._reasons) or "-",
                 f" aborted={cut_short}" if cut_short else "")


class Registry:
    """Every job in flight, the queue limit, and the drain on shutdown."""

    def __init__(self, bridge: AsyncEngine, metrics: Metrics, max_queue: int | None) -> None:
        self.bridge = bridge
        self.metrics = metrics
        self.max_queue = max_queue
        self.draining = False
        self._jobs: dict[str, Job] = {}
        self._empty = trio.Event()
        self._empty.set()

    def __len__(self) -> int:
        return len(self._jobs)

    def open(
        self, public_id: str, prepared: Sequence[Prepared], nursery: trio.Nursery
    ) -> Job:
        """Admit one HTTP request's prompts, or raise the ApiError that refuses it."""
        if self.draining:
            raise ApiError(503, "the server is shutting down", None, "shutting_down")
        try:
            check_unused(public_id, self._jobs)
        except ParamError as exc:  # the header is the field at this layer
            raise ApiError(400, exc.message, "X-Request-Id", "duplicate_request_id") from None
        if self.max_queue is not None:
            s = self.bridge.statistics()
            # Waiting = arrivals not yet taken at a boundary + the scheduler's waiting queue.
            waiting = s.queued + s.waiting
            if len(prepared) > self.max_queue:
                raise ApiError(400, f"{len(prepared)} prompts exceed the queue limit of "
                               f"{self.max_queue}", "prompt", "too_many_prompts")
            if waiting + len(prepared) > self.max_queue:
                raise ApiError(429, f"the server is busy: {waiting} requests are waiting "
                               f"(limit {self.max_queue}); retry later", None, "queue_full",
                               {"Retry-After": "1"})
        try:
            job = Job(self, public_id, prepared, trio.current_time())
        except ParamError as exc:  # e.g. an engine request id already taken
            raise from_param_error(exc) from None
        self._jobs[public_id] = job
        self._empty = trio.Event() if self._empty.is_set() else self._empty
        job.start(nursery)
        return job

    def remove(self, job: Job) -> None:
        if self._jobs.get(job.id) is job:
            del self._jobs[job.id]
        if not self._jobs:
            self._empty.set()

    async def wait_empty(self) -> None:
        await self._empty.wait()

    def end_all(self, message: str) -> None:
        for job in list(self._jobs.values()):
            job.end(503, message, "shutting_down")

    async def drain(self, grace: float) -> int:
        """Refuse new requests, let those in flight finish for up to `grace` seconds, then
        end the rest (a stream gets an error frame and [DONE], a unary request a 503).
        Returns how many were ended; their readers finish them as they next run."""
        self.draining = True
        with trio.move_on_after(grace):
            await self.wait_empty()
        cut = len(self._jobs)
        if cut:
            log.warning("shutdown grace of %.1f s is over: ending %d request(s)", grace, cut)
            self.end_all("the server is shutting down")
        return cut
