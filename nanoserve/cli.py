"""`nanoserve generate | bench | serve`."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from nanoserve import bench, flags
from nanoserve.config import ConfigError
from nanoserve.model.base import ModelStartError
from nanoserve.model.hub import hub_name
from nanoserve.model.parallel.startup import exit_status


def _generate(a: argparse.Namespace) -> int:
    from nanoserve.config import EngineConfig
    from nanoserve.llm import LLM
    from nanoserve.model.preflight import check_device, check_model
    from nanoserve.sampling.params import ParamError, SamplingParams

    check_device(a.device)  # before the weights load, as serve and bench judge theirs
    context = check_model(a.model, "float32", 1, EngineConfig(), a.device).max_model_len
    if a.max_tokens >= context:
        raise ConfigError(f"--max-tokens {a.max_tokens} leaves no room for a prompt in the "
                          f"model's context of {context} tokens")
    llm = LLM(a.model, device=a.device, seed=a.seed)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, seed=a.seed)
    prompt = a.prompt
    if a.chat:
        prompt = llm.tokenizer.encode_chat([{"role": "user", "content": a.prompt}])
    try:
        out = llm.generate(prompt, params, use_tqdm=False)[0]  # one prompt: no bar
    except ParamError as exc:  # the prompt against --max-tokens and the context
        raise ConfigError(str(exc)) from None
    print(out.text)
    print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]", file=sys.stderr)
    return 0


def _check_isa() -> None:
    """NANOSERVE_ISA, if set, names an instruction set this CPU runs: judged before any
    model loads or port binds, as every other setting is. Only judged: `auto`'s choice is
    measured when a model first needs the kernels (native.isa()), never for the stub."""
    from nanoserve.model import native

    try:
        native.pick_isa(os.environ.get("NANOSERVE_ISA"))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _fold_hub_flags(a: argparse.Namespace) -> None:
    """--revision and --gguf-file folded into --model's hub id (org/name@rev:file), the one
    name every layer and tensor-parallel rank resolves (model/hub.py). The served name stays
    --model as given, as vLLM's does under --revision."""
    revision, gguf_file = getattr(a, "revision", None), getattr(a, "gguf_file", None)
    if revision is None and gguf_file is None:
        return
    if getattr(a, "served_model_name", "") is None:
        a.served_model_name = a.model
    try:
        a.model = hub_name(a.model, revision, gguf_file)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    return exit_status(_main(argv))


def _main(argv: list[str] | None) -> int:
    p = flags.Parser(prog="nanoserve")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="complete one prompt offline and print the text")
    g.add_argument("prompt")
    g.add_argument("--model", default="smollm2", help="as serve's: a name, a path, or a "
                   "Hugging Face hub id (org/name, org/name:Q4_K_M, org/name@revision)")
    g.add_argument("--revision", default=None, help="the hub id's branch, tag or commit")
    g.add_argument("--gguf-file", default=None, metavar="NAME", help="the hub id's GGUF file")
    g.add_argument("--max-tokens", type=flags.positive_int, default=64)
    g.add_argument("--temperature", type=flags.non_negative_float, default=0.0)
    g.add_argument("--seed", type=flags.seed, default=0)
    g.add_argument("--device", default="cpu")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    b = sub.add_parser("bench", help="offline throughput on hf_peer.py's workload")
    bench.add_args(b)
    s = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    from nanoserve.server import main as server_main

    server_main.add_args(s)
    a = p.parse_args(argv)
    fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    level = getattr(a, "log_level", "info").upper()
    logging.basicConfig(level=getattr(logging, level), format=fmt)
    try:
        _check_isa()
        _fold_hub_flags(a)
        if a.cmd == "generate":
            return _generate(a)
        if a.cmd == "bench":
            bench.run(a)
            return 0
        return server_main.run(a)
    except ConfigError as exc:
        # A setting that can never work: one line naming the flags, as argparse's own errors.
        print(f"nanoserve {a.cmd}: error: {exc.cli_text()}", file=sys.stderr)
        return 2
    except ModelStartError as exc:  # a tensor-parallel rank that never came up: its message
        print(f"nanoserve {a.cmd}: error: {exc}", file=sys.stderr)  # names it, and why
        return 2


if __name__ == "__main__":
    sys.exit(main())
