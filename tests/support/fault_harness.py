"""What the fault tests share: bodies, an engine with injected faults, a step listener
that notes which step carried which tokens, a request's reference run on a clean server,
and the checks that a fault ended only its own requests."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import trio
import trio.testing

from nanoserve.bridge.clock import StepClock
from nanoserve.config import EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.engine.outputs import StepResult
from nanoserve.server import server_state
from sim.replay.faults import Fault, inject
from support.http_harness import AsgiHarness, serving, stub_parts
from support.server_harness import GOOD, make_app, make_engine

C = "/v1/completions"
STREAM = {**GOOD, "max_tokens": 10, "stream": True, "ignore_eos": True}
UNARY = {**STREAM, "stream": False}
BOUND_S = 30  # a bound on a wait that must end, never a measurement


async def settle() -> None:
    await trio.testing.wait_all_tasks_blocked()


def faulty_engine(*faults: Fault, **cfg: Any) -> Engine:
    model, tok = stub_parts()
    config = EngineConfig(**{"block_size": 16, "num_blocks": 128, "max_model_len": 1024, **cfg})
    return inject(model, tok, faults, config)


class Steps:
    """Per engine request id: (step, token ids) of every update that carried tokens."""

    def __init__(self, app: Any) -> None:
        self.by_id: dict[str, list[tuple[int, tuple[int, ...]]]] = defaultdict(list)
        server_state(app).ready.bridge.add_step_listener(self)  # type: ignore[union-attr]

    def __call__(self, result: StepResult) -> None:
        for u in result.updates:
            if u.new_token_ids:
                self.by_id[u.request_id].append((result.step, u.new_token_ids))

    def tokens(self, rid: str) -> list[int]:
        return [t for _, ids in self.by_id[rid] for t in ids]

    def steps(self, rid: str) -> list[int]:
        return [s for s, _ in self.by_id[rid]]


async def reference(body: dict[str, Any]) -> tuple[list[int], str]:
    """Token ids and text of `body` alone on a clean server."""
    app = make_app(make_engine(), clock=StepClock())
    async with serving(app) as h:
        steps = Steps(app)
        r = await h.post(C, {**body, "stream": False})
        assert r.status == 200, r.body
        return steps.tokens("cmpl-0"), r.json()["choices"][0]["text"]


def error_frame(events: list[str]) -> dict[str, Any]:
    """A failed stream's ending: its error frame, then [DONE]; the error object returned."""
    assert events[-1] == "[DONE]", events
    err: dict[str, Any] = json.loads(events[-2])["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert all("choices" in json.loads(e) for e in events[:-2])
    return err


async def assert_healthy_and_free(h: AsgiHarness, engine: Engine) -> None:
    assert (await h.request("GET", "/health")).status == 200
    s = engine.statistics()
    assert (s.running, s.waiting, s.free_blocks) == (0, 0, s.num_blocks)
