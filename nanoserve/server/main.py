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

from nanoserve import flags
from nanoserve.bridge.clock import LiveClock
from nanoserve.config import ConfigError, EngineConfig, speculative_config_arg
from nanoserve.engine.engine import Engine
from nanoserve.model.base import ModelStartError
from nanoserve.model.parallel import BACKENDS, DEFAULT_HEARTBEAT_TIMEOUT_S, DEFAULT_TIMEOUT_S
from nanoserve.model.preflight import check_device, check_model
from nanoserve.model.quant import CHOICES
from nanoserve.server import checks, hypercorn_fixes
from nanoserve.server.app import create_app, drain
from nanoserve.server.config import AgentSettings, CorsPolicy, ServerConfig
from nanoserve.server.recording import Recorder
from nanoserve.server.tools import REASONING_PARSERS, TOOL_PARSERS

log = logging.getLogger("nanoserve.server")

# Hypercorn's grace runs past ours by this much, so the app ends streams, not Hypercorn.
_HYPERCORN_EXTRA_GRACE_S = 1.0


def add_args(p: argparse.ArgumentParser) -> None:
    """`serve`'s flags, in --help's three groups: the model, the engine, the HTTP server."""
    _model_args(p.add_argument_group("model"))
    _engine_args(p.add_argument_group("engine"))
    _http_args(p.add_argument_group("HTTP server"))
    _agent_args(p.add_argument_group("agents (vLLM's flags)"))


def _model_args(g: argparse._ArgumentGroup) -> None:
    a = g.add_argument
    a("--model", default="smollm2", help="smollm2, stub, a path to a Llama folder or GGUF, or "
      "a Hugging Face hub id: org/name, org/name:Q4_K_M (that GGUF), org/name@revision "
      "(its cache, HF_HUB_CACHE and HF_HUB_OFFLINE are huggingface_hub's)")
    a("--revision", default=None, help="the hub id's branch, tag or commit [main]")
    a("--gguf-file", default=None, metavar="NAME",
      help="the hub id's GGUF file, by name (or a quant tag: Q4_K_M)")
    a("--served-model-name", type=flags.non_empty, default=None,
      help="the name clients use (default: --model)")
    a("--device", default="cpu")
    a("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    a("--quantization", default="auto", choices=CHOICES,
      help="auto: a GGUF's own Q4_0/Q4_1/Q8_0 blocks; none: float32; q8_0/q4_0/q4_1: that "
      "format for every matrix [auto]")
    a("--int8-activations", action="store_true",
      help="round activations to 8 bits in projections of 128+ rows (prefill) and of one "
      "row (batch-1 decode): faster, not token-identical to the default "
      "(scripts/int8_kl.py measures how far)")
    a("--tensor-parallel-size", "-tp", type=flags.positive_int, default=1,
      help="shard the weights over N processes (torch.distributed) [1]")
    a("--distributed-backend", default="auto", choices=BACKENDS,
      help="auto: nccl on CUDA, gloo on the CPU [auto]")
    a("--tp-exact", action="store_true",
      help="sum the shards in rank order (all-gather) instead of all-reduce: bitwise "
      "reproducible across runs and against the in-process emulation")
    a("--distributed-timeout", type=flags.positive_float, default=DEFAULT_TIMEOUT_S,
      metavar="SECONDS", help="seconds the tensor-parallel ranks may take to start (import, "
      f"load, join; slow on a busy host), and the process group's timeout [{DEFAULT_TIMEOUT_S:g}]")
    a("--distributed-heartbeat-timeout", type=flags.positive_float,
      default=DEFAULT_HEARTBEAT_TIMEOUT_S, metavar="SECONDS",
      help="seconds a tensor-parallel rank may go silent (stopped, hung) before it is taken as "
      f"lost: the engine fails and /health answers 503 [{DEFAULT_HEARTBEAT_TIMEOUT_S:g}]")
    a("--chat-template", default=None, help="a Jinja template, or a file holding one, or "
      "chatml-tools (nanoserve's ChatML that renders tools) [smollm2-tools for smollm2 and "
      "stub: SmolLM2's own, with tools]")


def _engine_args(g: argparse._ArgumentGroup) -> None:
    a = g.add_argument
    a("--block-size", type=flags.positive_int, default=16)
    kv = g.add_mutually_exclusive_group()
    kv.add_argument("--num-blocks", type=flags.positive_int, default=None)
    kv.add_argument("--kv-cache-memory", type=flags.size_bytes, default=None,
                    help="bytes for the KV pool, e.g. 2GiB")
    a("--max-num-seqs", type=flags.positive_int, default=64)
    a("--max-num-batched-tokens", type=flags.positive_int, default=512)
    a("--max-model-len", type=flags.positive_int, default=None)
    a("--seed", type=flags.seed, default=0)
    a("--speculative-config", type=speculative_config_arg, default=None,
      help='speculative decoding, as vLLM\'s JSON: \'{"method": "ngram", '
      '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\' (n-gram prompt lookup; '
      'the tokens are the same as without it) [off]')
    a("--max-queue", type=flags.non_negative_int, default=1024,
      help="waiting requests beyond which new ones get 429")


def _http_args(g: argparse._ArgumentGroup) -> None:
    a = g.add_argument
    a("--host", default="127.0.0.1")
    a("--port", type=flags.port, default=8000, help="0 picks a free port (logged once bound)")
    a("--api-key", type=flags.non_empty, default=None, help="require 'Authorization: Bearer KEY' "
      "(default: $NANOSERVE_API_KEY)")
    a("--max-body-bytes", type=flags.size_bytes, default=16 << 20)
    a("--body-timeout", type=flags.positive_float, default=30.0,
      help="seconds to receive a request body before answering 408")
    a("--shutdown-grace", type=flags.non_negative_float, default=10.0)
    a("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    a("--record", type=flags.output_file, default=None, metavar="FILE",
      help="write a trace of the traffic to FILE at shutdown (sim replay repeats it)")
    a("--record-redact", action="store_true",
      help="with --record: replace prompts by synthetic text of the same token count")
    # CORS, as vLLM's flags (JSON lists) and defaults: any origin may call, no credentials.
    a("--allowed-origins", type=flags.json_str_list, default=["*"],
      help='origins a browser page may call from, e.g. \'["https://app.example"]\' [["*"]]')
    a("--allowed-methods", type=flags.json_str_list, default=["*"],
      help='methods a cross-origin request may use [["*"]]')
    a("--allowed-headers", type=flags.json_str_list, default=["*"],
      help='headers a cross-origin request may send [["*"]]')
    a("--allow-credentials", action="store_true",
      help="let cross-origin requests carry cookies and Authorization (never with a `*`)")


def _agent_args(g: argparse._ArgumentGroup) -> None:
    a = g.add_argument
    a("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
      help="how tool calls are read out of the model's text [hermes for ChatML templates]")
    a("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=None,
      help='let requests use tool_choice "auto" (the model decides whether to call) '
      "[on: wherever the chat template renders tools; --no-enable-auto-tool-choice refuses "
      "it, as vLLM does without the flag]")
    a("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
      help="split <think>...</think> into reasoning_content")


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
        model, tokenizer = load(a.model, device=a.device, dtype=a.dtype,
                                quantization=a.quantization,
                                tensor_parallel_size=a.tensor_parallel_size,
                                distributed_backend=a.distributed_backend,
                                tp_exact=a.tp_exact,
                                distributed_timeout=a.distributed_timeout,
                                distributed_heartbeat_timeout=a.distributed_heartbeat_timeout,
                                int8_activations=a.int8_activations)
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
