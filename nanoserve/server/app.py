"""The app factory: a Quart-Trio app around one engine, for `nanoserve serve`, for tests
(driven in-process over ASGI or a real socket) and for the replay harness.

Everything that would make two runs differ is injected: the clock (how steps map to
seconds), `id_source` (the tail of `cmpl-...` ids) and `time_source` (epoch seconds for
`created`). With a step or virtual clock, a counter and a fixed time, a replay reproduces
every byte of every response.

The engine's life in the app (started with it, loaded in a thread if need be, stopped with
it) is server/lifespan.py's; the connection class under Quart's requests (how a response's
sending ends, the recorder's hook) is server/connection.py's.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import time
from collections.abc import Callable

from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from nanoserve.bridge import BridgeStats, EngineDeadError
from nanoserve.bridge.clock import Clock, LiveClock
from nanoserve.server import admin, generation, openapi
from nanoserve.server.connection import Connection
from nanoserve.server.cors import CorsMiddleware
from nanoserve.server.errors import ApiError, error_object
from nanoserve.server.lifespan import EngineSource, engine_lifespan
from nanoserve.server.metrics import Metrics
from nanoserve.server.offload import Offload
from nanoserve.server.recording import Recorder
from nanoserve.server.respond import json_response
from nanoserve.server.responses import route as responses_route
from nanoserve.server.settings import ServerConfig
from nanoserve.server.state import ServerState, counter_ids, current_state

log = logging.getLogger("nanoserve.server")


def create_app(
    engine: EngineSource,
    config: ServerConfig,
    *,
    clock: Clock,
    id_source: Callable[[], str] | None = None,
    time_source: Callable[[], float] = time.time,
    on_fatal: Callable[[BaseException], None] | None = None,
    recorder: Recorder | None = None,
) -> QuartTrio:
    """`engine` is a built Engine, or a callable that builds one (run in a thread at
    startup). `on_fatal` is called if that load fails, so `serve` can exit non-zero.
    `recorder` (server.recording; `serve --record`) is told what a trace needs, and is
    closed once the engine has stopped."""
    # No static folder: Quart would otherwise add an undocumented /static/<path> route.
    app = QuartTrio("nanoserve", static_folder=None)
    app.asgi_http_class = Connection
    app.config.update(
        RESPONSE_TIMEOUT=None,  # would cut long streams without their terminator
        BODY_TIMEOUT=config.body_timeout,
        MAX_CONTENT_LENGTH=config.max_body_bytes,
    )
    def bridge_stats() -> BridgeStats | None:  # for /metrics, read at each scrape
        return st.ready.bridge.statistics() if st.ready else None

    st = ServerState(config, Metrics(config.served_model_name, bridge_stats),
                     id_source or counter_ids(), time_source, recorder=recorder,
                     # Threads only where steps take real time (offload.py says why).
                     offload=Offload(config.request_threads
                                     if isinstance(clock, LiveClock) else None))
    app.extensions["nanoserve"] = st

    engine_lifespan(app, st, engine, clock, on_fatal)
    app.before_request(_authenticate)
    # Outside everything else: a preflight needs no key and is no request of the API.
    app.asgi_app = CorsMiddleware(app.asgi_app, config.cors)  # type: ignore[method-assign]
    app.register_error_handler(ApiError, _api_error)
    app.register_error_handler(EngineDeadError, _engine_dead)
    app.register_error_handler(HTTPException, _http_error)
    app.register_error_handler(Exception, _unexpected)
    generation.register(app)
    responses_route.register(app)
    admin.register(app)
    openapi.register(app)
    return app


async def _authenticate() -> None:
    """With an API key, every route but /health needs `Authorization: Bearer KEY`."""
    key = current_state().config.api_key
    if key is None or request.path == "/health":
        return
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    # compare_digest: the time taken must not say how much of a guess was right.
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                             key.encode()):
        raise ApiError(401, "missing or invalid API key: send 'Authorization: Bearer "
                       "<key>'", None, "invalid_api_key")


async def _after_the_body() -> None:
    """Hold an error's answer until its request's body has arrived. Hypercorn ends an
    HTTP/1.1 connection whose request is still arriving when the response is complete, so a
    keep-alive client that sent its next request in that moment read a disconnect instead of
    an answer (a 401, decided from the headers alone, did this under load). Routes read
    their body anyway; this is for the answers given without it (401, 404, 405, 503), within
    the limits a route's own read has (MAX_CONTENT_LENGTH, BODY_TIMEOUT), as nginx reads and
    discards a body it will not use. Only error answers wait here: they hold nothing, so a
    hang-up that cancels the wait loses nothing (a stream's answer, cancelled between its
    route and its send, would leave its job behind)."""
    # Too big or too slow after all: the answer stands, and the connection ends.
    with contextlib.suppress(HTTPException):
        await request.get_data(cache=False)


def server_state(app: QuartTrio) -> ServerState:
    st: ServerState = app.extensions["nanoserve"]
    return st


async def drain(app: QuartTrio, grace: float) -> int:
    """Begin a graceful shutdown: refuse new requests (503), give those in flight up to
    `grace` seconds, then end the rest. Returns how many were ended early."""
    st = server_state(app)
    st.draining = True
    if st.ready is None:
        return 0
    return await st.ready.registry.drain(grace)


async def _api_error(exc: ApiError) -> Response:
    await _after_the_body()
    return json_response(exc.body(), exc.status, exc.headers)


async def _engine_dead(exc: EngineDeadError) -> Response:
    # Wherever a route meets the stopped bridge (preparing a prompt, starting a job), the
    # client reads the same 503.
    await _after_the_body()
    err = ApiError(503, f"the engine is not running: {exc}", None, "engine_dead")
    return json_response(err.body(), err.status)


async def _http_error(exc: HTTPException) -> Response:
    code = exc.code or 500
    if code not in (408, 413):  # for these the body is what went wrong: the connection ends
        await _after_the_body()
    cfg = current_state().config
    message, err = {
        404: (f"no route {request.method} {request.path}", "not_found"),
        405: (f"method {request.method} is not allowed on {request.path}", "method_not_allowed"),
        408: (f"the request body did not arrive within {cfg.body_timeout} s", "body_timeout"),
        413: (f"the request body is over the limit of {cfg.max_body_bytes} bytes",
              "body_too_large"),
    }.get(code, (exc.description or exc.name, exc.name.lower().replace(" ", "_")))
    return json_response(ApiError(code, message, None, err).body(), code)


async def _unexpected(exc: Exception) -> Response:
    # Never expected for bad input (that is a 400 above); this is a server bug.
    log.exception("unhandled error in %s %s", request.method, request.path)
    return json_response(error_object(f"internal server error: {exc!r}", "server_error", None,
                                      "internal_error"), 500)
