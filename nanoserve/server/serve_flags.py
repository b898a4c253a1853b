"""`nanoserve serve`'s flags, in --help's groups: the model, the engine, the HTTP server and
agents (vLLM's flags). main.py turns what they parse into the configs and serves."""

from __future__ import annotations

import argparse

from nanoserve import flags
from nanoserve.config import speculative_config_arg
from nanoserve.model.parallel import BACKENDS, DEFAULT_HEARTBEAT_TIMEOUT_S, DEFAULT_TIMEOUT_S
from nanoserve.model.quant import CHOICES
from nanoserve.server.tools import REASONING_PARSERS, TOOL_PARSERS


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
