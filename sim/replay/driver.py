"""The replay driver: one trace through the real app, in process, one step boundary at a time.

The app is nanoserve's own Quart-Trio app (`create_app`), called through its ASGI callable;
its engine loop runs on a `ReplayClock` (clock.py), which takes a step boundary only when the
driver opens one. Each boundary goes:

1. `wait_all_tasks_blocked()`: every task has reacted to the last step (frames sent,
   handlers waiting on their next update, hang-ups turned into aborts);
2. the arrivals due at this boundary start, *one at a time* in trace order, each followed by
   another wait, so each reaches the bridge's inbox before the next begins: admission order
   (and with it the schedule and every unseeded request's seed) is the trace's, not Trio's;
3. every client, in trace order, reads what it reads now and hangs up if it is time;
4. if the engine has work, the driver opens the boundary: the bridge applies aborts then
   arrivals and runs one step (under the virtual clock it then sleeps the step's modelled
   cost, which `MockClock(autojump_threshold=0)` skips at once).

Trio runs ready tasks in a random order (docs/ARCHITECTURE.md, pitfalls); nothing above
depends on it, because every input reaches the engine before a boundary that waits for
quiescence. Nothing reads wall time: ids come from the client's trace position, `created`
is 0.

The engine has no idle steps: if it runs out of work before a request's `at_step`, that
request joins the next boundary (and the replay notes it). Under the virtual clock the driver
sleeps until the next `at_s` instead. Token ids and steps come from the bridge's step
listener, text and statuses from the wire (`sim.trace.expect` says which field comes from where).
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict, deque
from dataclasses import dataclass, field

import trio
import trio.testing

from nanoserve.bridge import AsyncEngine
from nanoserve.engine.outputs import StepResult
from nanoserve.server import ServerConfig, checks, create_app, server_state
from nanoserve.server.settings import AgentSettings
from sim.http.asgi_client import AsgiClient, serve_in_process
from sim.replay.clients import Client
from sim.replay.clock import ReplayClock
from sim.replay.faults import inject, kills_loop, parse_faults, quiet_injected
from sim.replay.setup import CostFn, Weights, engine_config
from sim.trace.expect import ChoiceOutcome, EndOutcome, Outcome, RequestOutcome
from sim.trace.format import Trace

MAX_STEPS = 1_000_000  # a replay that runs this long is stuck, not slow
_ENGINE_ID = re.compile(r"(?:chat)?cmpl-(\d+)(?:-(\d+))?")


@dataclass(slots=True)
class _Produced:
    """What the engine produced for one client, per choice index."""

    tokens: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    finish: dict[int, str] = field(default_factory=dict)
    first_step: int | None = None
    last_step: int | None = None


@dataclass(frozen=True, slots=True)
class Observed:
    outcome: Outcome
    problems: tuple[str, ...]  # invariant violations, one line each
    warnings: tuple[str, ...]


async def settle() -> None:
    await trio.testing.wait_all_tasks_blocked()


class Driver:
    def __init__(self, trace: Trace, weights: Weights, cost: CostFn | None) -> None:
        h = trace.header
        self.virtual = h.clock == "virtual"
        self.clock = ReplayClock(cost if self.virtual else None)
        faults = parse_faults(h.faults)
        # An injected fault that kills the loop is the trace's point, not a broken replay.
        self.death_expected = kills_loop(faults)
        self.engine = inject(weights.model, weights.tokenizer, faults,
                             engine_config(h, weights))
        s = h.server
        config = ServerConfig(h.model, max_queue=h.engine.get("max_queue"),
                              body_timeout=h.body_timeout,
                              chat_template=checks.chat_template(s.get("chat_template")),
                              agents=AgentSettings(s.get("tool_call_parser"),
                                                   s.get("enable_auto_tool_choice", False),
                                                   s.get("reasoning_parser")))
        self.app = create_app(self.engine, config, clock=self.clock, id_source=self._next_id,
                              time_source=lambda: 0.0)
        self.clients = [Client(i, r) for i, r in enumerate(trace.requests)]
        self.produced = [_Produced() for _ in self.clients]
        self._starting: int | None = None
        self._problems: list[str] = []
        self._warnings: list[str] = []
        self._t0 = 0.0
        self._bridge: AsyncEngine | None = None

    def _next_id(self) -> str:
        if self._starting is None:  # only a request the driver is starting asks for one
            self._problems.append("an id was asked for outside a request's start")
            return "x"
        return str(self._starting)

    def _now(self) -> float:
        return trio.current_time() - self._t0

    async def run(self) -> Observed:
        self._t0 = trio.current_time()
        with quiet_injected():
            return await self._run()

    async def _run(self) -> Observed:
        async with serve_in_process(self.app) as asgi:
            ready = server_state(self.app).ready
            assert ready is not None  # a built engine is ready once startup completes
            ready.bridge.add_step_listener(self._on_step)
            self._bridge = ready.bridge
            await self._drive(asgi, ready.bridge)
            end = self._end(ready.bridge)
        requests = tuple(self._outcome(c) for c in self.clients)
        end = dataclasses.replace(end, aborted=sum(r.aborted for r in requests))
        outcome = Outcome(requests, end)
        self._check(outcome)
        return Observed(outcome, tuple(self._problems), tuple(self._warnings))

    async def _drive(self, asgi: AsgiClient, bridge: AsyncEngine) -> None:
        pending = deque(self.clients)
        while True:
            await settle()
            step, idle = self.engine.num_steps, not self._has_work(bridge)
            while pending and self._due(pending[0], step, idle):
                c = pending.popleft()
                self._starting = c.number
                ex = asgi.start(c.req.path, c.req.body, c.req.client.send_body_bytes,
                                c.req.raw_body)
                c.started(ex, step, self._now())
                await settle()
                self._starting, idle = None, False
            for c in self.clients:
                c.react(step, self._now())
            await settle()
            if self._has_work(bridge):
                self.clock.open_boundary()
                await settle()
                await self.clock.step_over()
                if self.clock.tickets or self.engine.num_steps > MAX_STEPS:
                    why = "stopped" if self.clock.tickets else f"ran past {MAX_STEPS} steps"
                    self._problems.append(f"end invariant: the engine loop {why} at step "
                                          f"{self.engine.num_steps} with work left "
                                          f"(healthy: {bridge.healthy})")
                    return
            elif pending and self.virtual:
                await trio.sleep_until(self._t0 + (pending[0].req.at_s or 0.0))
            elif not pending:
                if all(c.done for c in self.clients):
                    return
                for c in self.clients:  # idle for good: time may pass for stalled bodies
                    if c.stalled and c.ex is not None and not c.done:
                        await c.ex.wait_complete()
                for c in self.clients:  # idle for good: the slow readers finish reading
                    c.react(step, self._now(), drain=True)

    def _dead(self, bridge: AsyncEngine) -> bool:
        """The loop died of the fault the trace injected: no step will come again."""
        return self.death_expected and not bridge.healthy

    def _has_work(self, bridge: AsyncEngine) -> bool:
        if self._dead(bridge):
            return False  # the engine's state is abandoned as it was; nothing can run it
        return self.engine.has_unfinished() or bridge.statistics().queued > 0

    def _due(self, c: Client, step: int, idle: bool) -> bool:
        if self.virtual:
            return (c.req.at_s or 0.0) <= self._now()
        at = c.req.at_step or 0
        if at > step and idle and self._bridge is not None and self._dead(self._bridge):
            return True  # no step will come: the arrival meets the dead server now
        if at > step and idle:
            self._warnings.append(f"{c.req.id} at_step {at}: the engine was idle after step "
                                  f"{step}, so it joined step {step + 1}")
            return True
        return at <= step

    def _on_step(self, result: StepResult) -> None:
        for u in result.updates:
            m = _ENGINE_ID.fullmatch(u.request_id)
            if m is None or int(m.group(1)) >= len(self.clients):
                self._problems.append(f"step {result.step}: an update for unknown request "
                                      f"{u.request_id!r}")
                continue
            client = self.clients[int(m.group(1))]
            choice = int(m.group(2) or 0) * client.n + u.index
            p = self.produced[client.number]
            if u.new_token_ids:
                p.tokens[choice].extend(u.new_token_ids)
                if p.first_step is None:
                    p.first_step = result.step
                p.last_step = result.step
            if u.finished and u.finish_reason is not None:
                p.finish[choice] = u.finish_reason

    def _end(self, bridge: AsyncEngine) -> EndOutcome:
        s = self.engine.statistics()
        dead = self._dead(bridge)
        if self.engine.has_unfinished() and not dead:
            self._problems.append(f"end invariant: the engine still holds "
                                  f"{s.running + s.waiting} request(s) after every client "
                                  "finished")
        elif bridge.statistics().in_flight:
            self._problems.append(f"end invariant: {bridge.statistics().in_flight} request(s) "
                                  "still in flight in the bridge after every client finished")
        return EndOutcome(steps=s.steps, num_blocks=s.num_blocks, free_blocks=s.free_blocks,
                          peak_used_blocks=s.peak_used_blocks, preemptions=s.preemptions,
                          aborted=0,  # filled in from the requests' outcomes
                          loop_failed=not bridge.healthy)

    def _outcome(self, c: Client) -> RequestOutcome:
        p = self.produced[c.number]
        refused = c.status is not None and c.status >= 400 and not p.tokens
        count = 0 if refused else max(c.num_choices(), *(i + 1 for i in p.tokens),
                                      *(i + 1 for i in c.texts), 0)
        hung = c.hangup_step is not None
        choices = tuple(
            ChoiceOutcome(p.finish.get(i) or c.wire_finish.get(i) or ("abort" if hung else None),
                          tuple(p.tokens.get(i, ())), "".join(c.texts.get(i, ())),
                          c.calls.of(i))
            for i in range(count)
        )
        aborted = hung and any(i not in p.finish for i in range(count))
        return RequestOutcome(c.req.id, c.status, c.error, choices, p.first_step, p.last_step,
                              c.frames, aborted, c.hangup_step)

    def _check(self, outcome: Outcome) -> None:
        """The invariants (docs/ARCHITECTURE.md) one run can check (the twin checks the
        rest)."""
        e = outcome.end
        # After a death the trace asked for, the engine is left as the fault found it (the
        # bridge does not touch a failed engine): its blocks stay held. What must hold then
        # is that every client got an answer, which the checks below still ask.
        if e.free_blocks != e.num_blocks and not (e.loop_failed and self.death_expected):
            self._problems.append(f"end invariant: free_blocks {e.free_blocks} at the end, the "
                                  f"pool has {e.num_blocks} (blocks leaked)")
        for c, r in zip(self.clients, outcome.requests, strict=True):
            if r.hangup_step is not None:
                if r.last_step is not None and r.last_step > r.hangup_step + 1:
                    self._problems.append(f"{r.id} invariant: hung up at step {r.hangup_step} "
                                          f"but produced a token at step {r.last_step}")
                continue
            if c.ex is None or not c.ex.complete:
                self._problems.append(f"{r.id} invariant: the response never completed")
                continue
            if r.status != 200:
                continue
            if c.stream and not c.saw_done:
                self._problems.append(f"{r.id} invariant: the stream ended without [DONE]")
            lost = [i for i in range(len(r.choices)) if i not in c.wire_finish]
            if lost and r.error is None:
                self._problems.append(f"{r.id} invariant: choice {lost[0]} never received a "
                                      "finish_reason")
            if c.usage_tokens is not None and c.usage_tokens != r.completion_tokens:
                self._problems.append(f"{r.id} invariant: usage says {c.usage_tokens} "
                                      f"completion tokens, the engine produced "
                                      f"{r.completion_tokens}")

