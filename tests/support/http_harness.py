"""A minimal ASGI driver for tests: requests, streams and hang-ups without a socket.

Quart-Trio's own test client deadlocks on streams and hangs after a disconnect (docs/ARCHITECTURE.md
pitfalls), so tests drive the ASGI callable directly: the harness plays the server's side
of the protocol (lifespan startup and shutdown, `http.request` body messages in, the
`http.response.start` and `http.response.body` messages out) and can send
`http.disconnect` at any point, which is how a client hanging up reaches an app.

Everything is unbounded channels and tasks in one nursery: no sleeps, no timers, so tests
stay deterministic under the gate clock and `wait_all_tasks_blocked()`.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio

from sim.http import asgi_client
from sim.http.asgi_client import lifespan, sse_events
from sim.http.loopback import hypercorn_on_loopback  # noqa: F401  (re-exported for the tests)

Message = dict[str, Any]


@dataclass(slots=True)
class HttpResponse:
    status: int
    headers: dict[str, str]  # names lowercased
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def events(self) -> list[str]:
        return sse_events(self.body)


@dataclass(slots=True, eq=False)
class Exchange(asgi_client.Exchange):
    """One request in progress: feed its body, read its response, hang up. The replay
    driver's exchange (status, headers, body, SSE split, `disconnect()`), plus the blocking
    reads and body feeding a test wants."""

    release_start: Callable[[], None] = lambda: None

    async def send_body(self, chunk: bytes, *, more: bool = False) -> None:
        await self._to_app.send({"type": "http.request", "body": chunk, "more_body": more})

    async def _pull(self) -> bool:
        """Take one message from the app; False once the response is complete."""
        if self.complete:
            return False
        self._take(await self._from_app.receive())
        return True

    def ready_events(self) -> list[str]:
        """The SSE payloads the app has sent so far, without waiting: for gate-clock tests,
        after `wait_all_tasks_blocked()`."""
        self.poll()
        out = list(self.events)
        self.events.clear()
        return out

    async def start(self) -> int:
        """Wait for the status line."""
        while self.status is None:
            if not await self._pull():
                raise AssertionError("response ended without http.response.start")
        return self.status

    async def next_event(self) -> str | None:
        """The next SSE `data:` payload, or None once the body has ended."""
        while True:
            self._split()
            if self.events:
                return self.events.popleft()
            if not await self._pull():
                return None

    async def read_all(self) -> HttpResponse:
        while await self._pull():
            pass
        assert self.status is not None
        return HttpResponse(self.status, self.headers, bytes(self.body))


class AsgiHarness:
    def __init__(self, app: Any, nursery: trio.Nursery) -> None:
        self.app = app
        self.nursery = nursery

    async def open(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        complete_body: bool = True,
        hold_start: bool = False,
    ) -> Exchange:
        """Start a request. With `complete_body=False` the body is not sent: the test feeds
        it with `send_body` (or never does, to play a stalled client). With `hold_start`
        the app's send of the status line blocks until `release_start()`."""
        if json_body is not None:
            body = json.dumps(json_body).encode()
        raw = body or b""
        hdrs = {"content-type": "application/json", **(headers or {})}
        if complete_body:
            hdrs.setdefault("content-length", str(len(raw)))
        to_app, app_in = trio.open_memory_channel[Message](math.inf)
        app_out, from_app = trio.open_memory_channel[Message](math.inf)
        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.1"},
            "http_version": "1.1", "method": method, "scheme": "http", "path": path,
            "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(k.lower().encode(), v.encode()) for k, v in hdrs.items()],
            "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000), "extensions": {},
        }

        ex = Exchange(to_app, from_app)
        start_gate = trio.Event()
        if not hold_start:
            start_gate.set()
        ex.release_start = start_gate.set

        async def send(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                await start_gate.wait()  # a network that has not taken the status line yet
            await app_out.send(msg)

        async def call() -> None:
            async with app_out:
                await self.app(scope, app_in.receive, send)

        self.nursery.start_soon(call)
        if complete_body:
            await ex.send_body(raw)
        return ex

    async def request(self, method: str, path: str, **kw: Any) -> HttpResponse:
        ex = await self.open(method, path, **kw)
        return await ex.read_all()

    async def post(self, path: str, body: Any, **kw: Any) -> HttpResponse:
        return await self.request("POST", path, json_body=body, **kw)


@asynccontextmanager
async def serving(app: Any) -> AsyncIterator[AsgiHarness]:
    """Run the app's lifespan around the block, as a server would."""
    async with lifespan(app) as requests:
        yield AsgiHarness(app, requests)


@functools.cache
def stub_parts() -> tuple[Any, Any]:
    """The stub model and its (real) tokenizer, loaded once per test process: loading
    hashes the embedded GGUF, about two seconds, and every server test module needs it."""
    from nanoserve.model import load

    return load("stub")
