"""Faults at the HTTP level (issue 9, part 3), in process through the ASGI harness, on the gate
clock: a model step that raises, a tokenizer that raises at encode and at decode, and an
engine loop that dies. Each fault is injected by sim.replay.faults' wrappers around the
stub's parts.

A fault the engine can contain affects only its own requests: they end with an error (a
stream: an error frame, then [DONE]; unary: a 500 with the OpenAI error object), everyone
else gets exactly the tokens a clean server gives, every block comes back, /health stays 200.
A fault the loop cannot survive turns /health 503 and ends every waiting and running request
with an error; new requests get 503. Steps are counted on the gate clock, tokens taken from
the bridge's step listener, and references come from a clean engine.

The status of an engine failure is 500 `server_error` (code `engine_error`), not a 4xx: the
request was valid and the server failed it; nor 503, which tells a client the server is
overloaded or going away and to retry elsewhere, while this server keeps serving.
"""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing
from support.fault_harness import (
    BOUND_S,
    STREAM,
    UNARY,
    C,
    Steps,
    assert_healthy_and_free,
    error_frame,
    faulty_engine,
    reference,
    settle,
)
from support.http_harness import serving, stub_parts
from support.server_harness import assert_error, make_app

from nanoserve.bridge import AsyncEngine
from nanoserve.bridge.clock import GateClock, StepClock
from nanoserve.sampling.params import SamplingParams
from nanoserve.server import server_state
from sim.replay.faults import Fault, quiet_injected


async def test_a_step_that_raises_fails_only_that_steps_requests() -> None:
    gate, engine = GateClock(), faulty_engine(Fault("step_raises", 3), max_num_seqs=2)
    app = make_app(engine, clock=gate)
    waiting_body = {**STREAM, "prompt": "The quick brown fox", "seed": 4}
    later_body = {**UNARY, "prompt": "Tell me a story", "seed": 5}
    async with serving(app) as h:
        steps = Steps(app)
        stream = await h.open("POST", C, json_body=STREAM)
        unary = await h.open("POST", C, json_body=UNARY)
        waiting = await h.open("POST", C, json_body=waiting_body)  # max_num_seqs 2: it waits
        await settle()  # all three queued before the first boundary
        gate.release(3)  # steps 1 and 2 run; step 3 raises in the model's forward
        with trio.fail_after(BOUND_S):
            r = await stream.read_all()
            u = await unary.read_all()
        assert r.status == 200  # two frames went out before the fault
        err = error_frame(r.events())
        assert (err["type"], err["code"]) == ("server_error", "engine_error")
        assert "step failed" in err["message"]
        assert "step 3" in err["message"]
        assert len(r.events()) == 2 + 2  # two frames, the error, [DONE]
        assert assert_error(u, 500, None)["code"] == "engine_error"
        assert steps.steps("cmpl-0") == steps.steps("cmpl-1") == [1, 2]
        assert engine.statistics().failed == 2
        # The waiting request was in no step: it runs on, from step 4, token for token.
        gate.release(10)
        with trio.fail_after(BOUND_S):
            w = await waiting.read_all()
        assert w.status == 200
        assert w.events()[-1] == "[DONE]"
        want, _ = await reference(waiting_body)
        assert steps.tokens("cmpl-2") == want
        assert steps.steps("cmpl-2") == list(range(4, 14))
        # A request arriving after the fault: served normally, exact tokens and text.
        later = await h.open("POST", C, json_body=later_body)
        await settle()
        gate.release(10)
        with trio.fail_after(BOUND_S):
            lr = await later.read_all()
        want_ids, want_text = await reference(later_body)
        assert lr.status == 200
        assert (steps.tokens("cmpl-3"), lr.json()["choices"][0]["text"]) == (want_ids, want_text)
        assert steps.steps("cmpl-3") == list(range(14, 24))
        assert gate.steps_run == 23
        await assert_healthy_and_free(h, engine)


async def test_a_prompt_the_tokenizer_cannot_encode_is_refused_alone() -> None:
    gate, engine = GateClock(), faulty_engine(Fault("encode_raises", "POISON"))
    app = make_app(engine, clock=gate)
    async with serving(app) as h:
        steps = Steps(app)
        good = await h.open("POST", C, json_body=STREAM)
        await settle()
        bad = await h.post(C, {**STREAM, "prompt": "a POISON prompt"})
        err = assert_error(bad, 500, None)
        assert (err["type"], err["code"]) == ("server_error", "internal_error")
        assert "cannot encode 'POISON'" in err["message"]
        chat = {"model": "stub", "messages": [{"role": "user", "content": "POISON"}]}
        assert assert_error(await h.post("/v1/chat/completions", chat), 500, None)
        stats = server_state(app).ready.bridge.statistics()  # type: ignore[union-attr]
        assert (stats.in_flight, stats.queued) == (1, 1)  # only the good one was accepted
        gate.release(10)
        with trio.fail_after(BOUND_S):
            r = await good.read_all()
        assert r.status == 200
        assert r.events()[-1] == "[DONE]"
        assert steps.tokens("cmpl-0") == (await reference(STREAM))[0]
        await assert_healthy_and_free(h, engine)


async def test_a_token_the_detokenizer_cannot_decode_fails_its_request_alone() -> None:
    victim = {**STREAM, "prompt": "Story: once upon a time", "seed": 4, "max_tokens": 16}
    bystander = {**STREAM, "prompt": "def step(self):", "seed": 2, "max_tokens": 16}
    victim_ids, _ = await reference(victim)
    bystander_ids, _ = await reference(bystander)
    # The first of the victim's tokens (past its third) that the bystander never decodes
    # (nor the victim before it): not in either prompt, not among the bystander's tokens.
    encode = stub_parts()[1].encode
    seen = {*bystander_ids, *encode(victim["prompt"]), *encode(bystander["prompt"])}
    k = next(i for i, t in enumerate(victim_ids) if i >= 3 and t not in seen
             and t not in victim_ids[:i])
    gate = GateClock()
    engine = faulty_engine(Fault("detokenize_raises", victim_ids[k]))
    app = make_app(engine, clock=gate)
    async with serving(app) as h:
        steps = Steps(app)
        streams = [await h.open("POST", C, json_body=b) for b in (victim, bystander)]
        unary = await h.open("POST", C, json_body={**victim, "stream": False})
        await settle()
        gate.release(16)
        with trio.fail_after(BOUND_S):
            v, b = [await s.read_all() for s in streams]
            u = await unary.read_all()
        assert v.status == 200
        err = error_frame(v.events())
        assert err["code"] == "engine_error"
        assert "detokenizer" in err["message"]
        assert assert_error(u, 500, None)["code"] == "engine_error"
        for rid in ("cmpl-0", "cmpl-2"):  # the poisoned token was the last one each made
            assert steps.tokens(rid) == victim_ids[: k + 1]
            assert steps.steps(rid)[-1] == k + 1
        assert b.status == 200
        assert b.events()[-1] == "[DONE]"
        assert steps.tokens("cmpl-1") == bystander_ids
        assert engine.statistics().failed == 2
        await assert_healthy_and_free(h, engine)


async def test_an_engine_loop_that_dies_fails_everything_and_refuses_new_work() -> None:
    gate, engine = GateClock(), faulty_engine(Fault("schedule_raises", 3), max_num_seqs=2)
    app = make_app(engine, clock=gate)
    async with serving(app) as h:
        running = await h.open("POST", C, json_body=STREAM)
        unary = await h.open("POST", C, json_body=UNARY)
        waiting = await h.open("POST", C, json_body={**STREAM, "seed": 9})
        await settle()
        gate.release(3)  # steps 1 and 2, then the scheduler raises outside any step
        with trio.fail_after(BOUND_S):
            r, u, w = [await ex.read_all() for ex in (running, unary, waiting)]
        assert r.status == 200
        assert len(r.events()) == 2 + 2  # two frames, the error, [DONE]
        err = error_frame(r.events())
        assert err["code"] == "engine_error"
        assert "engine loop failed" in err["message"]
        assert assert_error(u, 500, None)["code"] == "engine_error"
        # The waiting stream had no frame yet: its status is still free to say the error.
        assert assert_error(w, 500, None)["code"] == "engine_error"
        with trio.fail_after(BOUND_S):
            health = await h.request("GET", "/health")
            refused = [await h.post(C, body) for body in (STREAM, UNARY)]
        assert assert_error(health, 503, None)["code"] == "engine_dead"
        for r in refused:
            assert assert_error(r, 503, None)["code"] == "engine_dead"
        assert (await h.request("GET", "/v1/models")).status == 200
        state = server_state(app).ready
        assert state is not None
        assert len(state.registry) == 0
        assert state.bridge.statistics().in_flight == 0
        assert gate.steps_run == 3


async def test_quiet_injected_silences_the_bridge_and_the_server_only_for_injected_faults(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A replay of a fault trace must not print the traceback the bridge logs when its loop
    # dies (the loggers are named, so a module move cannot rename one from under the filter).
    engine = faulty_engine(Fault("schedule_raises", 1))
    caplog.set_level(logging.ERROR)
    with quiet_injected():
        async with AsyncEngine.open(engine, StepClock()) as bridge:
            out = await bridge.generate(bridge.prepare([1000, 1001], SamplingParams(
                temperature=0, max_tokens=2)))
    assert out.outputs[0].finish_reason == "error"
    assert not [r for r in caplog.records if r.exc_info]
    caplog.clear()
    logging.getLogger("nanoserve.bridge").error("not injected", exc_info=ValueError("x"))
    with quiet_injected():
        logging.getLogger("nanoserve.bridge").error("not injected", exc_info=ValueError("y"))
    assert len(caplog.records) == 2
