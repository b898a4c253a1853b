"""Schemathesis against the served `/openapi.json`, through a real Hypercorn socket.

The server runs in this test's Trio loop (tests/support/http_harness.hypercorn_on_loopback) with an
API key; schemathesis, which is synchronous (`requests`), runs in a worker thread, so the
server's loop stays the only event loop. For every documented operation it generates bodies
that fit the document (positive) and bodies that do not (negative), sends each with the
key, and checks: no 5xx, a documented status, a documented content type and headers, and a
body that fits the schema documented for that status. Afterwards every KV block is free.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
from support.http_harness import hypercorn_on_loopback
from support.server_harness import make_app, make_engine

from nanoserve.bridge.clock import LiveClock
from nanoserve.server import server_state

schemathesis = pytest.importorskip("schemathesis")
requests = pytest.importorskip("requests")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

SECRET = "sk-schemathesis"
AUTH = {"Authorization": f"Bearer {SECRET}"}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_headers_conformance, response_schema_conformance]
MODES = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]


def run_schemathesis(url: str, max_examples: int) -> dict[str, int]:
    """Every operation, both modes; returns how many cases each status answered."""
    seen: dict[str, int] = {}
    with requests.Session() as session:
        doc = session.get(f"{url}/openapi.json", headers=AUTH, timeout=30).json()
        schema = schemathesis.openapi.from_dict(doc)
        for result in schema.get_all_operations():
            op = result.ok()
            # Nothing to get wrong in a GET without parameters: only positive cases exist.
            modes = MODES if op.body.items or op.headers.items else MODES[:1]
            for mode in modes:

                @settings(max_examples=max_examples, deadline=None, derandomize=True,
                          database=None, suppress_health_check=list(HealthCheck))
                @given(op.as_strategy(generation_mode=mode))
                def check(case: Any) -> None:
                    response = case.call(base_url=url, session=session, headers=AUTH,
                                         timeout=120)
                    key = f"{case.method} {case.path} {response.status_code}"
                    seen[key] = seen.get(key, 0) + 1
                    case.validate_response(response, checks=CHECKS, headers=AUTH)

                check()
    return seen


async def test_schemathesis_finds_no_server_error_and_no_drift() -> None:
    # A real socket: real seconds. A short context bounds a body that leaves max_tokens out.
    app = make_app(make_engine(max_model_len=64), clock=LiveClock(), api_key=SECRET)
    async with hypercorn_on_loopback(app) as url:
        seen = await trio.to_thread.run_sync(run_schemathesis, url, 20)
        ready = server_state(app).ready
        assert ready is not None
        with trio.fail_after(60):  # a deadlock guard, not a stopwatch
            await ready.bridge.wait_idle()
        stats = ready.engine.statistics()
        assert (stats.free_blocks, stats.running, stats.waiting) == (stats.num_blocks, 0, 0)
    # It reached the model and the validators, not just the front door.
    assert seen.get("POST /v1/completions 200", 0) > 0, seen
    assert seen.get("POST /v1/chat/completions 200", 0) > 0, seen
    assert seen.get("POST /v1/completions 400", 0) > 0, seen
