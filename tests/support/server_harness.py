"""The stub-model app the server tests share: an engine and app on the step clock, the
error-object and still-serving checks, a live Hypercorn on loopback, and reading a
`nanoserve serve` child's log until it is ready."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from nanoserve.bridge.clock import LiveClock, StepClock
from nanoserve.config import EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.server import ServerConfig, counter_ids, create_app
from support.http_harness import AsgiHarness, hypercorn_on_loopback, stub_parts

CREATED = 1_700_000_000
GOOD = {"model": "stub", "prompt": "def step(self):", "max_tokens": 4, "temperature": 0.0}


def make_engine(**cfg: Any) -> Engine:
    model, tok = stub_parts()
    base: dict[str, Any] = {"block_size": 16, "num_blocks": 128, "max_model_len": 1024}
    return Engine(model, tok, EngineConfig(**{**base, **cfg}))


def make_app(engine: Any = None, *, clock: Any = None, **cfg: Any) -> Any:
    return create_app(
        engine if engine is not None else make_engine(),
        ServerConfig("stub", **cfg),
        clock=clock or StepClock(),
        id_source=counter_ids(),
        time_source=lambda: float(CREATED),
    )


def assert_error(r: Any, status: int, param: str | None) -> dict[str, Any]:
    assert r.status == status, r.body
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert err["message"]
    return err


async def assert_serving(h: AsgiHarness) -> None:
    r = await h.post("/v1/completions", GOOD)
    assert r.status == 200, r.body
    assert r.json()["usage"]["completion_tokens"] == 4



@asynccontextmanager
async def live(engine: Engine, clock: Any = None, name: str = "stub", **cfg: Any
               ) -> AsyncIterator[Any]:
    """Serve on a free loopback port; yield (base URL, app). `cfg`: ServerConfig's fields."""
    app = create_app(engine, ServerConfig(name, **cfg), clock=clock or LiveClock(),
                     id_source=counter_ids(), time_source=lambda: 1_700_000_000.0)
    async with hypercorn_on_loopback(app) as url:
        yield url, app



async def read_until_ready(stderr: trio.abc.ReceiveStream, log: list[str]) -> str:
    """The bound URL, once the log says so and says the weights have loaded (until then
    the server answers 503)."""
    buf, url = b"", None
    while True:
        chunk = await stderr.receive_some()
        if not chunk:
            raise AssertionError("server exited before it was ready:\n" + "\n".join(log))
        buf += chunk
        *lines, rest = buf.split(b"\n")
        buf = rest
        for line in lines:
            log.append(line.decode(errors="replace"))
            m = re.search(r"listening on (http://\S+)", log[-1])
            url = m.group(1) if m else url
            if url and "engine ready" in log[-1]:
                return url


async def keep_reading(stderr: trio.abc.ReceiveStream, log: list[str]) -> None:
    # A full pipe would block the server's logging, so the rest of stderr is drained too.
    buf = b""
    while chunk := await stderr.receive_some():
        buf += chunk
    log.extend(buf.decode(errors="replace").splitlines())
