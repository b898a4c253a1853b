"""Three fixes to Hypercorn 0.18's connection layer, installed before nanoserve serves.

1. A fault on one connection ends that connection only. Hypercorn's `TCPServer._close`
   half-closes the socket (`send_eof`) without taking the connection's send lock, and Trio's
   `SocketStream.send_eof` holds the stream's send-conflict detector across a checkpoint.
   On an HTTP/2 connection other tasks send at any moment (the h2 send task flushing DATA
   frames, a stream's task flushing HEADERS), so when a client sends GOAWAY while responses
   are still flowing, a `send_all` can start inside that checkpoint and raise
   `trio.BusyResourceError`. `protocol_send` expects only Broken/ClosedResourceError, so it
   escapes the connection's task group, then `serve_listeners`' handler nursery, and ends
   `hypercorn.trio.serve`: one client stopped the whole server (an h2c router in front of
   nanoserve did it at start-up; tests/server/test_hypercorn_fixes.py repeats it with the
   h2 library).
   `_SafeTCPServer` half-closes under the send lock, and skips the half-close when a send is
   under way (closing the socket ends that send with ClosedResourceError, which Hypercorn
   handles); and whatever else a connection raises is logged with its peer and ends that
   connection alone.

2. Reason phrases. Hypercorn hands h11 no reason, so status lines read `HTTP/1.1 404 ` and
   clients print "Client error '404 '". `_H11WithReasons` fills in the standard phrase
   (`http.HTTPStatus`); HTTP/2 has no reason phrase at all. It also skips Hypercorn's empty
   write at the end of a content-length body, which raced a client's hang-up into a second,
   unanswered access-log line for the request (see the method).

3. One access-log line per request. The empty write was one way a hang-up beat the end of a
   response; the last body write itself is the other (`_StreamLoggedOnce`).

Hypercorn builds these classes by name from its own modules (`hypercorn.trio.run` makes a
`TCPServer` per connection, `hypercorn.protocol.ProtocolWrapper` an `H11Protocol`, which
with `H2Protocol` makes an `HTTPStream` per request), so `install()` rebinds those names to
the subclasses here; `serve()` installs them and runs
`hypercorn.trio.serve`, and every nanoserve path that opens a socket goes through it.
`install()` is idempotent and checks the Hypercorn version it was written against: the
subclasses override private methods.
"""

from __future__ import annotations

import http
import logging
import time
from collections.abc import Awaitable, Callable
from importlib.metadata import version
from typing import Any

import h11
import hypercorn.config
import hypercorn.protocol
import hypercorn.protocol.h2
import hypercorn.protocol.h11
import hypercorn.trio
import hypercorn.trio.run
import trio
from hypercorn.events import RawData
from hypercorn.protocol.events import StreamClosed
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.utils import wrap_app

log = logging.getLogger("nanoserve.server")

# The release whose private methods the subclasses below override (requirements.txt pins it).
HYPERCORN_VERSION = "0.18.0"


class _SafeTCPServer(TCPServer):
    async def run(self) -> None:
        peer = _peer(self.stream)
        try:
            await super().run()  # its own `finally` closes the socket
        except* Exception as group:
            # Cancellation (a shutdown) is a BaseException and goes on up; anything else is
            # a fault of this connection alone.
            log.error("connection from %s ended by an error in the HTTP layer; the server "
                      "carries on", peer, exc_info=group)

    async def _close(self) -> None:
        if self.send_lock.locked():
            # A send is under way (or this very task holds the lock: Hypercorn closes from
            # inside a send that failed). Half-closing now would collide with it; closing
            # the socket ends that send with ClosedResourceError, which Hypercorn handles.
            await self.stream.aclose()
            return
        self.send_lock.acquire_nowait()  # no checkpoint between the test and the take
        try:
            await super()._close()  # send_eof, then aclose
        finally:
            self.send_lock.release()


class _StreamLoggedOnce(HTTPStream):
    """An HTTP stream access-logged once. Hypercorn logs a request as unanswered ("- -") the
    moment its connection closes, unless the stream is already marked done, which happens
    only after the app's last body message has been written. A client quick to hang up once
    it had the whole answer (Quart sends the content, then an empty last message; httpx
    closes as it leaves its `with` block) was then logged twice: "- -", then its status. Once
    the response has begun, whether it ended is known only when the app does: so a hang-up
    then is logged at the app's end, and only if the last message never went out."""

    _hung_up = False  # the connection closed after the response had begun

    async def handle(self, event: Any) -> None:
        if isinstance(event, StreamClosed) and self.state == ASGIHTTPState.RESPONSE:
            self.closed = True  # Hypercorn's own steps, less the log line
            self._hung_up = True
            if self.app_put is not None:
                await self.app_put({"type": "http.disconnect"})
            return
        await super().handle(event)

    async def app_send(self, message: Any) -> None:
        await super().app_send(message)
        if message is None and self._hung_up and self.state != ASGIHTTPState.CLOSED:
            # None: no response, as Hypercorn itself passes (its annotation says otherwise).
            await self.config.log.access(
                self.scope, None, time.time() - self.start_time)  # type: ignore[arg-type]


class _H11WithReasons(H11Protocol):
    async def _send_h11_event(self, event: Any) -> None:
        # Hypercorn's own method, with the reason phrase filled in, and without its write of
        # nothing: the end of a content-length body is zero bytes, and awaiting that empty
        # send let a client that had read the whole body and hung up be seen first, so the
        # request was access-logged twice, once as unanswered ("- -").
        if isinstance(event, h11.Response | h11.InformationalResponse) and not event.reason:
            phrase = _phrase(event.status_code)
            if phrase:
                event = type(event)(status_code=event.status_code, headers=event.headers,
                                    http_version=event.http_version, reason=phrase)
        try:
            data = self.connection.send(event)
        except h11.LocalProtocolError:
            if self.connection.their_state != h11.ERROR:
                raise
            return
        if data:
            await self.send(RawData(data=data))


def _phrase(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:  # a code with no standard phrase keeps the empty one
        return ""


def _peer(stream: Any) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]
        return f"{host}:{port}"
    except (AttributeError, OSError, ValueError):
        return "an unknown peer"


def install() -> None:
    """Make Hypercorn build nanoserve's connection classes (see the module docstring)."""
    found = version("hypercorn")
    if found != HYPERCORN_VERSION:
        raise RuntimeError(f"nanoserve's Hypercorn fixes were written for hypercorn "
                           f"{HYPERCORN_VERSION}, but {found} is installed")
    hypercorn.trio.run.TCPServer = _SafeTCPServer  # type: ignore[misc]
    hypercorn.protocol.H11Protocol = _H11WithReasons  # type: ignore[misc]
    hypercorn.protocol.h11.HTTPStream = _StreamLoggedOnce  # type: ignore[misc]
    hypercorn.protocol.h2.HTTPStream = _StreamLoggedOnce  # type: ignore[misc]


async def serve(
    app: Any,
    config: hypercorn.config.Config,
    *,
    shutdown_trigger: Callable[..., Awaitable[None]],
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
    sockets: hypercorn.config.Sockets | None = None,
) -> None:
    """`hypercorn.trio.serve` with the fixes installed; `task_status` gets the bound URLs.
    `sockets`, listening already, are served instead of binding `config.bind` here (so that
    `nanoserve serve` can refuse an address in one line before it starts: main.py)."""
    install()
    if sockets is None:
        await hypercorn.trio.serve(app, config, shutdown_trigger=shutdown_trigger,
                                   task_status=task_status)
        return
    # What hypercorn.trio.serve does, with the sockets passed on.
    await hypercorn.trio.run.worker_serve(
        wrap_app(app, config.wsgi_max_body_size, None), config, sockets=sockets,
        shutdown_trigger=shutdown_trigger, task_status=task_status)
