"""The recorder hook at the HTTP layer: what `nanoserve serve --record` learns per request.

A trace (sim/trace/format.py) describes a request by what its client did: the body
it sent, the step boundary it arrived at, how fast it read, when it hung up. The bridge
reports the step side (`bridge.BridgeRecorder`); this module reports the HTTP side of each
generation request, as an `ExchangeRecorder`: the raw body as it arrived, the engine request
ids the route turned it into, the status line and every body chunk once the transport took
it (a send that blocks is a socket pushing back on a slow reader), and a hang-up
(`http.disconnect` before the response ended).

The connection class wraps the ASGI `receive` and `send` of the generation routes only, so
a server without a recorder runs exactly the code it always did. The route links its engine
ids through the ASGI scope, which the connection and the Quart request share (Starlette
keeps its own per-request state in the scope the same way). The recorder itself lives in
`sim.record.recorder`; nanoserve never imports sim (the CLI's composition root hands it in).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable
from quart import request

from nanoserve.bridge import BridgeRecorder

if TYPE_CHECKING:
    from nanoserve.bridge import AsyncEngine
    from nanoserve.engine.engine import Engine
    from nanoserve.server.jobs import Job
    from nanoserve.server.settings import ServerConfig

log = logging.getLogger("nanoserve.server")

RECORD_KEY = "nanoserve.record"  # the ASGI scope key of a request's ExchangeRecorder
RECORDED_PATHS = ("/v1/completions", "/v1/chat/completions")


class ExchangeRecorder(Protocol):
    """One generation request's HTTP exchange. Calls come from the request's own tasks."""

    def body(self, chunk: bytes) -> None:
        """A chunk of the request body, as the client sent it."""

    def engine_ids(self, ids: Sequence[str]) -> None:
        """The engine requests the route queued for this exchange, in arrival order."""

    def sending(self) -> None:
        """The app is about to hand a message to the transport."""

    def sent(self, status: int | None, chunk: bytes, more: bool) -> None:
        """The transport took a message: the status line (`status`), or a body chunk."""

    def hangup(self) -> None:
        """The client went away (`http.disconnect`)."""

    def done(self) -> None:
        """The exchange is over, for any reason; called exactly once."""


class Recorder(BridgeRecorder, Protocol):
    """Everything `create_app(recorder=...)` calls, besides the bridge's hook."""

    @property
    def failed(self) -> bool:
        """Something could not be recorded (the recorder logged what): `serve` exits 1."""

    def start(self, engine: Engine, bridge: AsyncEngine, config: ServerConfig) -> None:
        """The engine is ready (before the first request reaches it)."""

    def exchange(self, path: str) -> ExchangeRecorder:
        """A generation request has begun (before its body has been read)."""

    def close(self, engine: Engine) -> None:
        """The bridge has closed (every request ended, its blocks freed): write it out."""


def safely(fn: Callable[..., object], *args: object) -> None:
    """Call a recorder; a recorder bug is logged, never allowed to fail a request."""
    try:
        fn(*args)
    except Exception:
        log.exception("recorder call %r failed", fn)


def recorded(recorder: Recorder | None, scope: Any) -> ExchangeRecorder | None:
    """The exchange to record for this ASGI scope, or None when it is not recorded."""
    if recorder is None or scope.get("method") != "POST":
        return None
    if scope.get("path") not in RECORDED_PATHS:
        return None
    try:
        ex = recorder.exchange(scope["path"])
    except Exception:
        log.exception("recorder %r failed to open an exchange", recorder)
        return None
    scope[RECORD_KEY] = ex
    return ex


def recording_receive(ex: ExchangeRecorder, receive: ASGIReceiveCallable) -> ASGIReceiveCallable:
    async def wrapped() -> Any:
        msg = await receive()
        if msg["type"] == "http.request":
            safely(ex.body, msg.get("body", b""))
        elif msg["type"] == "http.disconnect":
            safely(ex.hangup)
        return msg

    return wrapped


def recording_send(ex: ExchangeRecorder, send: ASGISendCallable) -> ASGISendCallable:
    async def wrapped(msg: Any) -> None:
        safely(ex.sending)
        await send(msg)
        if msg["type"] == "http.response.start":
            safely(ex.sent, msg["status"], b"", True)
        elif msg["type"] == "http.response.body":
            safely(ex.sent, None, msg.get("body", b""), msg.get("more_body", False))

    return wrapped


def link(job: Job) -> None:
    """Tell the current request's exchange recorder, if any, which engine requests it is.
    Called by the route right after it queued them, before any step boundary can run."""
    ex: ExchangeRecorder | None = request.scope.get(RECORD_KEY)  # type: ignore[assignment]
    if ex is not None:
        safely(ex.engine_ids, job.request_ids)
