"""The client side of ASGI, for the replay driver: an app served in-process, no socket.

Quart-Trio's test client deadlocks on long streams and hangs after a disconnect
(docs/ARCHITECTURE.md pitfalls), so the driver plays the server's part of the protocol
itself: lifespan startup and shutdown, the request body in, the response messages out, and
`http.disconnect` when a client hangs up. Every channel is unbounded and the app's `send`
never waits, so a client that reads slowly never slows the app (docs/ARCHITECTURE.md:
per-request queues are unbounded); what the app has sent simply waits here until the client
reads it.

Nothing here blocks on the app except lifespan and `wait_complete()` (for a client that
stalls its body, once the engine is idle): the driver reads what has arrived with `poll()`
after `trio.testing.wait_all_tasks_blocked()`, which is what keeps a replay a function of
its trace rather than of Trio's task order.
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio

Message = dict[str, Any]
DONE = "[DONE]"


@dataclass(slots=True, eq=False)
class Exchange:
    """One request in flight: its response as it arrives, and the client's hang-up."""

    _to_app: trio.MemorySendChannel[Message]
    _from_app: trio.MemoryReceiveChannel[Message]
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)  # names lowercased
    body: bytearray = field(default_factory=bytearray)
    complete: bool = False  # the app sent its last body message
    disconnected: bool = False
    _pending: bytearray = field(default_factory=bytearray)  # SSE bytes not yet split
    events: deque[str] = field(default_factory=deque)  # SSE payloads not yet read

    def poll(self) -> None:
        """Take whatever the app has sent so far, without waiting."""
        while not self.complete:
            try:
                msg = self._from_app.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
            self._take(msg)
        self._split()

    async def wait_complete(self) -> None:
        """Block until the app has sent its whole response. The one blocking read here: for
        a client that stalls, whose answer (a 408) comes only when time passes, and time
        passes (an autojump clock) only while every task, this one included, waits."""
        while not self.complete:
            try:
                self._take(await self._from_app.receive())
            except trio.EndOfChannel:
                break
        self._split()

    def _take(self, msg: Message) -> None:
        if msg["type"] == "http.response.start":
            self.status = msg["status"]
            self.headers = {k.decode().lower(): v.decode() for k, v in msg.get("headers", [])}
        elif msg["type"] == "http.response.body":
            chunk = msg.get("body", b"")
            self.body += chunk
            self._pending += chunk
            self.complete = not msg.get("more_body", False)

    def _split(self) -> None:
        block, sep, rest = bytes(self._pending).rpartition(b"\n\n")
        if sep:
            self._pending = bytearray(rest)
            self.events.extend(sse_events(block + sep))

    def disconnect(self) -> None:
        """The client hangs up: what a server sends the app when the socket closes."""
        if not self.disconnected:
            self.disconnected = True
            self._to_app.send_nowait({"type": "http.disconnect"})

    def json(self) -> Any:
        return json.loads(self.body)


def sse_events(body: bytes) -> list[str]:
    """The `data:` payloads of complete SSE events, in order."""
    out = []
    for block in body.decode().split("\n\n"):
        data = [line[len("data: "):] for line in block.split("\n") if line.startswith("data: ")]
        if data:
            out.append("\n".join(data))
    return out


class AsgiClient:
    def __init__(self, app: Any, nursery: trio.Nursery) -> None:
        self._app = app
        self._nursery = nursery

    def start(self, path: str, body: Any, send_bytes: int | None = None,
              raw_body: bytes | None = None) -> Exchange:
        """POST `body` as JSON to `path` (or `raw_body`, the exact bytes, where a trace kept
        them); the app's task starts at the next checkpoint. With `send_bytes`, the
        Content-Length announces the whole body but only its first `send_bytes` bytes are
        sent, and nothing after them (a client that stalls)."""
        raw = raw_body if raw_body is not None else json.dumps(body, ensure_ascii=False).encode()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(raw)).encode())]
        to_app, app_in = trio.open_memory_channel[Message](math.inf)
        app_out, from_app = trio.open_memory_channel[Message](math.inf)
        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.1"},
            "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
            "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": headers, "client": ("127.0.0.1", 50000),
            "server": ("127.0.0.1", 8000), "extensions": {},
        }  # fmt: skip
        if send_bytes is None:
            to_app.send_nowait({"type": "http.request", "body": raw, "more_body": False})
        else:
            to_app.send_nowait({"type": "http.request", "body": raw[:send_bytes],
                                "more_body": True})

        async def call() -> None:
            async with app_out:
                await self._app(scope, app_in.receive, app_out.send)

        self._nursery.start_soon(call)
        return Exchange(to_app, from_app)


@asynccontextmanager
async def serve_in_process(app: Any) -> AsyncIterator[AsgiClient]:
    """Run the app's lifespan around the block, as a server would; requests still running
    when the block ends are cancelled before shutdown."""
    async with lifespan(app) as requests:
        yield AsgiClient(app, requests)


@asynccontextmanager
async def lifespan(app: Any) -> AsyncIterator[trio.Nursery]:
    """The ASGI lifespan protocol around the block; yields the nursery to run requests in,
    which is cancelled when the block ends, before the app is told to shut down."""
    to_app, app_in = trio.open_memory_channel[Message](math.inf)
    app_out, from_app = trio.open_memory_channel[Message](math.inf)
    scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"},
             "state": {}}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(app, scope, app_in.receive, app_out.send)
        await to_app.send({"type": "lifespan.startup"})
        msg = await from_app.receive()
        if msg["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"app startup failed: {msg}")
        async with trio.open_nursery() as requests:
            try:
                yield requests
            finally:
                requests.cancel_scope.cancel()
        await to_app.send({"type": "lifespan.shutdown"})
        msg = await from_app.receive()
        if msg["type"] != "lifespan.shutdown.complete":
            raise RuntimeError(f"app shutdown failed: {msg}")
