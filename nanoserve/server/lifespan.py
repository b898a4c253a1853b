"""The engine's life inside the app: started with it, loaded if need be, served, stopped.

It is apart from server/app.py, which assembles the app (routes, auth, error answers),
because it is the one part that runs for the app's whole life rather than per request.

The engine loop lives in the app's nursery (Quart-Trio's lifespan nursery), so it starts
before the first request and outlives every request task. Given a loader instead of an
engine, the app starts serving at once and loads the weights in a worker thread; until they
are loaded `/health` and the model routes answer 503.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio
from quart_trio import QuartTrio

from nanoserve.bridge import AsyncEngine
from nanoserve.bridge.clock import Clock
from nanoserve.engine.engine import Engine
from nanoserve.engine.outputs import StepResult
from nanoserve.model.base import ModelStartError
from nanoserve.server import recording
from nanoserve.server.body.protocol import protocol
from nanoserve.server.jobs import Registry
from nanoserve.server.offload import freeze_heap
from nanoserve.server.state import Ready, ServerState
from nanoserve.server.token_text import TokenText

log = logging.getLogger("nanoserve.server")

EngineSource = Engine | Callable[[], Engine]
_PROGRESS_EVERY_S = 10.0


def engine_lifespan(app: QuartTrio, st: ServerState, engine: EngineSource, clock: Clock,
                    on_fatal: Callable[[BaseException], None] | None) -> None:
    """The engine task starts with the app and stops with it. It has its own cancel scope:
    on shutdown it is cancelled (which closes the bridge and aborts whatever is left) and
    awaited, so shutdown ends with every KV block free. Quart-Trio's
    BACKGROUND_TASK_SHUTDOWN_TIMEOUT must stay a number: set to None it cancels the
    lifespan task itself, before it reports shutdown complete."""
    scope = trio.CancelScope()
    stopped = trio.Event()

    @app.before_serving
    async def start_engine() -> None:
        await app.nursery.start(_engine_task, st, engine, clock, on_fatal, scope, stopped)

    @app.after_serving
    async def stop_engine() -> None:
        scope.cancel()
        await stopped.wait()


async def _engine_task(
    st: ServerState,
    source: EngineSource,
    clock: Clock,
    on_fatal: Callable[[BaseException], None] | None,
    scope: trio.CancelScope,
    stopped: trio.Event,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    try:
        with scope:
            await _run_engine(st, source, clock, on_fatal, task_status)
    finally:
        stopped.set()


async def _run_engine(
    st: ServerState,
    source: EngineSource,
    clock: Clock,
    on_fatal: Callable[[BaseException], None] | None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    if isinstance(source, Engine):
        engine = source
    else:
        task_status.started()  # serve (and answer 503) while the weights load
        try:
            engine = await _load(source)
        except Exception as exc:
            if isinstance(exc, ModelStartError):  # its message says it all: no traceback
                log.error("the model failed to load: %s", exc)
            else:
                log.exception("the model failed to load")
            st.load_error = repr(exc)
            if on_fatal is not None:
                on_fatal(exc)
            return
    try:
        await _serve_engine(st, engine, clock, source, task_status)
    finally:
        if st.recorder is not None:  # the bridge has closed: every request has ended
            recording.safely(st.recorder.close, engine)


async def _serve_engine(
    st: ServerState,
    engine: Engine,
    clock: Clock,
    source: EngineSource,
    task_status: trio.TaskStatus[None],
) -> None:
    async with AsyncEngine.open(engine, clock, st.recorder) as bridge:

        def on_step(result: StepResult) -> None:
            # Runs in the loop task between steps, the one time reading the engine is safe.
            st.metrics.on_step(result, engine.statistics(), trio.current_time())

        bridge.add_step_listener(on_step)
        registry = Registry(bridge, st.metrics, st.config.max_queue)
        if st.recorder is not None:
            recording.safely(st.recorder.start, engine, bridge, st.config)
        api = protocol(st.config.served_model_name, engine.model.config.vocab_size,
                       engine.max_model_len)
        st.ready = Ready(engine, bridge, registry, TokenText(engine.tokenizer), api)
        if st.offload.threaded:  # real time: a collector's pause is a stall (offload.py)
            freeze_heap()
        st.loaded.set()
        if isinstance(source, Engine):
            task_status.started()
        log.info("engine ready: %d KV blocks of %d tokens, max_model_len %d",
                 engine.pool.num_blocks, engine.pool.block_size, engine.max_model_len)
        await trio.sleep_forever()  # until the lifespan nursery is cancelled on shutdown


async def _load(loader: Callable[[], Engine]) -> Engine:
    started = trio.current_time()

    async def progress() -> None:
        while True:
            await trio.sleep(_PROGRESS_EVERY_S)
            log.info("still loading the model (%.0f s)", trio.current_time() - started)

    failure: Exception | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(progress)
        try:
            # abandon_on_cancel: a shutdown during a long load must not wait for it to finish.
            engine = await trio.to_thread.run_sync(loader, abandon_on_cancel=True)
        except Exception as exc:  # raised below: the loader's own error, not a group of one
            failure = exc
        nursery.cancel_scope.cancel()
    if failure is not None:
        raise failure
    log.info("model loaded in %.1f s", trio.current_time() - started)
    return engine
