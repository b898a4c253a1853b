"""Continuous batching with a token budget.

There are no prefill and decode phases. Each step has a budget of
`max_num_batched_tokens`; running requests are served first, in admission order, each
taking what it still needs (one token for a decoding request, the rest of the prompt, or
as much of it as the budget allows: chunked prefill); then waiting requests are admitted
while the budget, `max_num_seqs` and the pool allow. When a running request cannot get a
block, the most recently admitted running request is preempted by recompute: its blocks are
freed, it goes back to the front of the waiting queue with its generated tokens kept, and
when it is admitted again it prefills prompt and output together (often mostly from the
prefix cache, since its blocks keep their names until they are reused).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

from nanoserve.engine.kv import KVManager
from nanoserve.engine.request import Request, Status


@dataclass(frozen=True, slots=True)
class Scheduled:
    request: Request
    num_tokens: int  # tokens of this request computed this step

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the request's tokens (and its proposal, if
        any), so it samples."""
        return self.request.num_computed + self.num_tokens >= self.request.num_tokens


@dataclass(frozen=True, slots=True)
class Schedule:
    scheduled: tuple[Scheduled, ...]
    preempted: tuple[Request, ...]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class SchedulerFactory(Protocol):
    """What builds an engine's scheduler: `Scheduler` itself, or a subclass."""

    def __call__(self, kv: KVManager, *, max_num_seqs: int,
                 max_num_batched_tokens: int) -> Scheduler: ...


class Scheduler:
    def __init__(self, kv: KVManager, *, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def add_first(self, req: Request) -> None:
        """A request that goes before every waiting one (a forked sibling that found no
        block for its copy of the prompt's last block)."""
        self.waiting.appendleft(req)

    def add_running(self, req: Request) -> None:
        """A request that enters already computed (a forked sibling)."""
        req.status = Status.RUNNING
        self.running.append(req)

    def remove(self, req: Request) -> None:
        """Take a request out of the queues and give its blocks back (finish or abort)."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        self.kv.free(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Schedule:
        budget = self.max_num_batched_tokens
        out: list[Scheduled] = []
        preempted: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed, budget)
            # Asked first, without _make_room's allocation: this runs once per running
            # request per step, and most of them fit the blocks they hold.
            if not self.kv.holds(req, n) and not self._make_room(req, n, preempted):
                break  # `req` itself was preempted; everything after it already was
            out.append(Scheduled(req, n))
            budget -= n
            i += 1

        # Admitting new work while running requests are being evicted would only evict
        # them again next step: admit only on a step that preempted nobody.
        while not preempted and self.waiting and budget > 0:
            if len(self.running) >= self.max_num_seqs:
                break
            req = self.waiting[0]
            hits = self.kv.find_prefix(req) if req.num_computed == 0 else []
            computed = req.num_computed + len(hits) * self.kv.block_size
            n = min(req.num_tokens - computed, budget)
            if not self.kv.allocate(req, n, hits):
                break
            self.waiting.popleft()
            if req.num_preemptions == 0:
                req.num_cached_prompt = min(computed, req.num_prompt)
            req.status = Status.RUNNING
            self.running.append(req)
            out.append(Scheduled(req, n))
            budget -= n
        return Schedule(tuple(out), tuple(preempted))

    def place_proposals(self, schedule: Schedule) -> Schedule:
        """`schedule` with its requests' proposals (Request.draft) added to their tokens,
        as far as the budget and the pool have room left: a proposal is worth less than a
        neighbour's place in the batch, so it comes after every request's own tokens (and
        after admissions), never takes a block someone needs, and never preempts; what
        does not fit is dropped."""
        budget = self.max_num_batched_tokens - schedule.num_tokens
        out = list(schedule.scheduled)
        for j, sched in enumerate(out):
            req = sched.request
            if not req.draft:
                continue
            del req.draft[max(budget, 0):]
            if req.draft and not self.kv.allocate(req, sched.num_tokens + len(req.draft)):
                req.draft.clear()
            out[j] = Scheduled(req, sched.num_tokens + len(req.draft))
            budget -= len(req.draft)
        return Schedule(tuple(out), schedule.preempted)

    def _make_room(self, req: Request, n: int, preempted: list[Request]) -> bool:
        """Allocate for `req`, preempting from the back of `running` until it fits.
        Returns False when `req` itself had to go."""
        while not self.kv.allocate(req, n):
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
