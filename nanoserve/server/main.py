"""`nanoserve serve`: the OpenAI-compatible server on Hypercorn's Trio worker.

Start-up binds the socket first and loads the weights after, in a worker thread, so a
supervisor sees the port open and `/health` answering 503 while a large model loads.

Shutdown (SIGINT or SIGTERM) is graceful: Hypercorn stops accepting connections, the app
answers new requests on open connections with 503, and requests in flight get up to
`--shutdown-grace` seconds to finish. Whatever is still running then is ended by the app
itself: a stream gets `data: {"error": ...}` and `data: [DONE]`, a unary request a 503.
Hypercorn's own grace period is set a second longer, so it never cuts a stream before the
app has ended it properly; it also waits that long for idle keep-alive connections (it does
not close them on shutdown), so a shutdown takes up to grace + 1 s. A second signal ends
everything at once. The exit status is 0
after a signal, 1 when the weights fail to load, and 2 when tensor-parallel ranks cannot start
(logged in one line that names them: nanoserve.model.parallel.group). With `--record FILE`
the trace is written once the engine has stopped, after every request has ended, so a
graceful shutdown leaves a complete trace.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator
from importlib.metadata import entry_points

import hypercorn.config
import trio

from nanoserve.bridge.clock import LiveClock
from nanoserve.config import ConfigError, EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.model.base import ModelStartError
from nanoserve.model.options import LoadOptions
from nanoserve.model.preflight import check_device, check_model
from nanoserve.server import checks, hypercorn_fixes
from nanoserve.server.app import create_app, drain
from nanoserve.server.recording import Recorder
from nanoserve.server.serve_flags import add_args as add_args  # cli.py's, and the tests'
from nanoserve.server.settings import AgentSettings, CorsPolicy, ServerConfig

log = logging.getLogger("nanoserve.server")

# Hypercorn's grace runs past ours by this much, so the app ends streams, not Hypercorn.
_HYPERCORN_EXTRA_GRACE_S = 1.0


def load_options(a: argparse.Namespace) -> LoadOptions:
    """How the weights load, as the model group of flags says (serve_flags.py)."""
    return LoadOptions(
        device=a.device, dtype=a.dtype, quantization=a.quantization,
        tensor_parallel_size=a.tensor_parallel_size, distributed_backend=a.distributed_backend,
        tp_exact=a.tp_exact, distributed_timeout=a.distributed_timeout,
        distributed_heartbeat_timeout=a.distributed_heartbeat_timeout,
        int8_activations=a.int8_activations,
    )


def engine_config(a: argparse.Namespace) -> EngineConfig:
    extra = {} if a.kv_cache_memory is None else {"kv_cache_memory": a.kv_cache_memory}
    return EngineConfig(
        block_size=a.block_size, num_blocks=a.num_blocks, max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens, max_model_len=a.max_model_len,
        seed=a.seed, speculative=a.speculative_config, **extra,
    )


# The embedded models' chat templates when --chat-template is not given: SmolLM2's (the stub
# speaks its tokenizer) is its own plus tools, so tool calling works with no flag, as under
# llama.cpp's server and Ollama; Gemma 3 270M is a base model with no template at all (a
# chat request is a 400 that says to use /v1/completions), so it gets none, nor tools.
EMBEDDED_TEMPLATES = {"smollm2": "smollm2-tools", "stub": "smollm2-tools"}


def server_config(a: argparse.Namespace) -> ServerConfig:
    template = checks.chat_template(a.chat_template or EMBEDDED_TEMPLATES.get(a.model))
    cors = CorsPolicy(tuple(a.allowed_origins), tuple(a.allowed_methods),
                      tuple(a.allowed_headers), a.allow_credentials)
    return ServerConfig(
        served_model_name=a.served_model_name or a.model,
        api_key=a.api_key or os.environ.get("NANOSERVE_API_KEY") or None,
        max_queue=a.max_queue, max_body_bytes=a.max_body_bytes, body_timeout=a.body_timeout,
        chat_template=template, model_root=a.model, cors=cors,
        agents=agent_settings(a),
    )


def agent_settings(a: argparse.Namespace) -> AgentSettings:
    """vLLM's flags, with "auto" on unless --no-enable-auto-tool-choice: vLLM refuses it
    without its flag, llama.cpp's server and Ollama allow it wherever the template can show
    the model its tools. A request still needs such a template and a parser (plan.py's 400s
    name the flag that would give each), so "on" means on wherever tools render."""
    auto = a.enable_auto_tool_choice is not False
    return AgentSettings(a.tool_call_parser, auto, a.reasoning_parser)


def run(a: argparse.Namespace) -> int:
    """Serve until a signal. A configuration that can never work raises ConfigError here,
    before the socket is bound (the command line prints it as one line and exits 2)."""
    checks.check_flags(a)
    check_device(a.device)
    cfg = engine_config(a)
    check_fits(a, cfg)
    config = server_config(a)
    hc = hypercorn_config(a)
    sockets = checks.listen(hc, a.host, a.port)  # last: nothing after it refuses a setting
    try:
        recorder = _recorder(a)
    except BaseException:
        checks.close(sockets)
        raise
    return exit_code(trio.run(_serve, a, cfg, config, recorder, hc, sockets), recorder,
                     a.record)


def exit_code(code: int, recorder: Recorder | None, record: str | None) -> int:
    """A recording that lost something is a failed run, however well the serving went."""
    if recorder is not None and recorder.failed:
        log.error("--record %s: the recording is incomplete (the errors above name what was "
                  "lost)", record)
        return code or 1
    return code


def check_fits(a: argparse.Namespace, cfg: EngineConfig) -> None:
    """Judge `cfg` against the model's metadata (its weights are loaded after the bind)
    and the memory its KV pool would take."""
    check_model(a.model, a.dtype, a.tensor_parallel_size, cfg, a.device, a.distributed_backend)


def hypercorn_config(a: argparse.Namespace) -> hypercorn.config.Config:
    hc = hypercorn.config.Config()
    hc.bind = [f"{a.host}:{a.port}"]
    hc.graceful_timeout = a.shutdown_grace + _HYPERCORN_EXTRA_GRACE_S
    hc.accesslog = logging.getLogger("hypercorn.access")
    hc.errorlog = logging.getLogger("hypercorn.error")
    return hc


async def _serve(
    a: argparse.Namespace, cfg: EngineConfig, config: ServerConfig, recorder: Recorder | None,
    hc: hypercorn.config.Config, sockets: hypercorn.config.Sockets,
) -> int:

    def loader() -> Engine:
        from nanoserve.model import load

        log.info("loading model %s (device %s, dtype %s)", a.model, a.device, a.dtype)
        model, tokenizer = load(a.model, load_options(a))
        return Engine(model, tokenizer, cfg)

    stop_requested, hurry, stop_serving, served = (trio.Event() for _ in range(4))
    failed: list[BaseException] = []

    def on_fatal(exc: BaseException) -> None:
        failed.append(exc)
        stop_requested.set()

    app = create_app(loader, config, clock=LiveClock(), id_source=lambda: uuid.uuid4().hex,
                     time_source=time.time, on_fatal=on_fatal, recorder=recorder)

    async def serve(task_status: trio.TaskStatus[list[str]]) -> None:
        await hypercorn_fixes.serve(app, hc, shutdown_trigger=stop_serving.wait,
                                    task_status=task_status, sockets=sockets)
        served.set()

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_signals, signals, stop_requested, hurry)
            binds = await nursery.start(serve)
            log.info("listening on %s (model %s)", ", ".join(binds), config.served_model_name)
            await stop_requested.wait()
            stop_serving.set()  # stop accepting; Hypercorn closes idle connections
            if not failed:
                async with trio.open_nursery() as drainer:
                    drainer.start_soon(_cancel_on, hurry, drainer.cancel_scope)
                    await drain(app, a.shutdown_grace)
                    drainer.cancel_scope.cancel()
                if hurry.is_set():
                    await drain(app, 0.0)
            await served.wait()
            nursery.cancel_scope.cancel()
    log.info("stopped")
    if failed and isinstance(failed[0], ModelStartError):
        return 2  # a start that cannot be, told in one line: as a refused setting
    return 1 if failed else 0


def _recorder(a: argparse.Namespace) -> Recorder | None:
    if a.record is None:
        return None
    # The recorder belongs with the trace format it writes, in sim, which imports nanoserve
    # and never the reverse: so it is found as a plugin, registered in pyproject.toml.
    found = entry_points(group="nanoserve.recorders", name="trace")
    if not found:
        raise ConfigError("--record: no trace recorder is installed (the `sim` package "
                          "registers one under the entry point group nanoserve.recorders)")
    recorder_class = next(iter(found)).load()
    log.info("recording traffic to %s%s", a.record, " (prompts redacted)"
             if a.record_redact else "")
    try:  # it creates (truncates) its file: last of the checks, one line if it cannot
        recorder: Recorder = recorder_class(a.record, weights=a.model, redact=a.record_redact)
    except OSError as exc:
        raise ConfigError(f"--record {a.record}: {exc.strerror or exc}") from None
    return recorder


async def _watch_signals(
    signals: AsyncIterator[int], first: trio.Event, second: trio.Event
) -> None:
    async for signum in signals:
        name = signal.Signals(signum).name
        if not first.is_set():
            log.info("%s: shutting down gracefully (again to stop at once)", name)
            first.set()
        else:
            log.info("%s again: ending every request now", name)
            second.set()


async def _cancel_on(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()
