"""A stopped reader is a stopped request, proved by step counts on the gate clock.

Each test hands the engine one step per ticket, hangs the client up (an `http.disconnect`
through the ASGI harness) at a chosen point, then hands over more tickets: the request must
be aborted at the next boundary, so no further step runs, and every KV block comes back.
The prompt is one whose greedy stub output has text at every step, so each step is a frame.
The last test is the graceful drain: requests in flight get their grace, the rest are ended
with an error frame and [DONE], in virtual time.
"""

from __future__ import annotations

import json
from typing import Any

import trio
import trio.testing
from support.http_harness import serving
from support.server_harness import GOOD, assert_error, make_app, make_engine

from nanoserve.bridge.clock import GateClock
from nanoserve.engine.engine import Engine
from nanoserve.server import drain, server_state

STREAM = {**GOOD, "max_tokens": 50, "stream": True, "ignore_eos": True}


async def settle() -> None:
    await trio.testing.wait_all_tasks_blocked()


def assert_all_free(engine: Engine, *, aborted: int) -> None:
    s = engine.statistics()
    assert (s.running, s.waiting, s.aborted) == (0, 0, aborted)
    assert s.free_blocks == s.num_blocks


async def test_stream_hangup_aborts_at_the_next_boundary() -> None:
    gate, engine = GateClock(), make_engine()
    app = make_app(engine, clock=gate)
    async with serving(app) as h:
        ex = await h.open("POST", "/v1/completions", json_body=STREAM)
        await settle()
        assert ex.ready_events() == []
        assert ex.status is None
        frames = []
        for step in (1, 2):
            gate.release(1)
            await settle()
            frames += ex.ready_events()
            assert ex.status == 200
            assert len(frames) == step
        ex.disconnect()
        await settle()
        gate.release(10)  # were the request still running, these would be ten more steps
        await settle()
        assert gate.steps_run == 2
        assert engine.num_steps == 2
        assert_all_free(engine, aborted=1)
        assert not ex.complete  # nobody wrote [DONE] to a client that had gone
        assert len(server_state(app).ready.registry) == 0  # type: ignore[union-attr]


async def test_hangup_before_the_first_token_never_runs_a_step() -> None:
    gate, engine = GateClock(), make_engine()
    async with serving(make_app(engine, clock=gate)) as h:
        ex = await h.open("POST", "/v1/completions", json_body=STREAM)
        await settle()
        ex.disconnect()
        await settle()
        gate.release(5)
        await settle()
        assert gate.steps_run == 0
        assert engine.statistics().free_blocks == engine.statistics().num_blocks
        assert not engine.has_unfinished()


async def test_hangup_while_the_status_line_is_being_sent_still_aborts() -> None:
    # Quart awaits the send of the status line before it enters the body: a hang-up there
    # never starts the body generator, so its `finally` cannot be what closes the request.
    gate, engine = GateClock(), make_engine()
    async with serving(make_app(engine, clock=gate)) as h:
        ex = await h.open("POST", "/v1/completions", json_body=STREAM, hold_start=True)
        gate.release(1)
        await settle()  # the handler has its first update and is sending the status line
        ex.disconnect()
        await settle()
        gate.release(10)
        await settle()
        assert gate.steps_run == 1
        assert_all_free(engine, aborted=1)


async def test_unary_client_that_gives_up_aborts_its_request() -> None:
    gate, engine = GateClock(), make_engine()
    async with serving(make_app(engine, clock=gate)) as h:
        ex = await h.open("POST", "/v1/completions", json_body={**STREAM, "stream": False})
        gate.release(3)
        await settle()
        ex.disconnect()
        await settle()
        gate.release(10)
        await settle()
        assert gate.steps_run == 3
        assert_all_free(engine, aborted=1)


async def test_hangup_aborts_every_prompt_of_a_batch() -> None:
    gate, engine = GateClock(), make_engine()
    async with serving(make_app(engine, clock=gate)) as h:
        body = {**STREAM, "prompt": ["def step(self):", "The quick brown fox"]}
        ex = await h.open("POST", "/v1/completions", json_body=body)
        gate.release(2)
        await settle()
        assert len(ex.ready_events()) >= 2
        assert ex.status == 200
        ex.disconnect()
        await settle()
        gate.release(10)
        await settle()
        assert gate.steps_run == 2
        assert_all_free(engine, aborted=2)


async def test_drain_lets_short_requests_finish_and_ends_the_rest(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate, engine = GateClock(), make_engine()
    app = make_app(engine, clock=gate)
    async with serving(app) as h:
        short = await h.open("POST", "/v1/completions", json_body={**STREAM, "max_tokens": 3})
        long = await h.open("POST", "/v1/completions", json_body=STREAM)
        unary = await h.open("POST", "/v1/completions", json_body={**STREAM, "stream": False})
        gate.release(1)
        assert await short.start() == 200
        assert await long.start() == 200
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain, app, 10.0)
            await trio.lowlevel.checkpoint()
            assert_error(await h.post("/v1/completions", GOOD), 503, None)  # no new work
            assert_error(await h.request("GET", "/health"), 503, None)
            gate.release(2)  # the short stream's last two tokens, within the grace
            events = (await short.read_all()).events()
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
            # The rest run past the grace (virtual seconds: the clock jumps when all wait).
            long_events = (await long.read_all()).events()
        assert trio.current_time() - start == 10.0
        err: Any = json.loads(long_events[-2])
        assert long_events[-1] == "[DONE]"
        assert err["error"]["code"] == "shutting_down"
        assert all("choices" in json.loads(e) for e in long_events[:-2])
        assert_error(await unary.read_all(), 503, None)
        gate.release(1)  # the boundary that takes the aborts
        await settle()
        assert gate.steps_run == 3
        assert_all_free(engine, aborted=2)
