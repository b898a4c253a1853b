"""`sim`: the simulator's command line; the only module that imports every command.

  sim convert CSV --out TRACE     an Azure LLM inference trace CSV -> a virtual-clock trace
  sim load --out TRACE ...        a synthetic virtual-clock trace (--load SPEC and/or flags)
  sim bench --url URL ...         an online load client for any OpenAI-compatible server
  sim replay TRACE ...            replay recorded traces through the real app and check them
  sim replay --target URL ...     check what a client sees of any OpenAI-compatible server
  sim record --upstream URL ...   a recording proxy in front of any such server
  sim capacity, profile, validate capacity planning: sweeps, the cost model, its check
  sim soak ...                    hang-up storms and slow readers against a live server

`sim load` takes its spec as one `--load` string, as individual flags, or both (a flag wins
over the same key in the string); either way one parser reads it (sim.load.spec). What the
commands share (the error guard, `--engine`) lives in sim.cli_util, which imports none.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nanoserve import flags
from nanoserve.config import ConfigError
from nanoserve.model.parallel.startup import exit_status
from sim.bench import bench_command
from sim.capacity import capacity_commands, profile, validate
from sim.cli_util import engine_overrides, guarded, tokenizer
from sim.load import spec as load_spec
from sim.load.azure import convert_azure, read_azure_csv
from sim.load.spec import load_spec_from_pairs, split_load_spec
from sim.load.synthetic import generate_load
from sim.record import proxy_cli
from sim.replay import replay_command
from sim.soak import run as soak
from sim.trace.write import write_trace

# Flags of `sim load` and the spec keys they set.
_LOAD_FLAGS = {
    "--n": "n", "--arrival": "arrival", "--rate": "rate", "--rate-end": "rate_end",
    "--duration": "duration", "--burstiness": "burstiness", "--prompt": "prompt",
    "--output": "output", "--shared-prefix": "shared_prefix", "--api": "api",
    "--hangup": "hangup", "--seed": "seed", "--model": "model",
}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    return exit_status(_main(argv))  # (a failed tensor-parallel start's thread: see there)


def _main(argv: list[str] | None) -> int:
    p = flags.Parser(prog="sim", description="nanoserve's simulator")
    sub = p.add_subparsers(dest="cmd")
    _add_convert(sub)
    _add_load(sub)
    bench_command.add_parser(sub)
    replay_command.add_parser(sub)
    proxy_cli.add_parser(sub)
    capacity_commands.add_parser(sub)
    profile.add_parser(sub)
    validate.add_parser(sub)
    soak.add_parser(sub)
    a = p.parse_args(argv)
    if a.cmd is None:
        p.print_help()
        return 0
    try:  # each subcommand reports and picks its exit status itself
        return int(a.main(a))
    except ConfigError as exc:  # engine settings that can never work: one line
        print(f"sim {a.cmd}: {exc}", file=sys.stderr)
        return 2


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, type=flags.output_file, metavar="TRACE",
                   help="the trace file to write")
    p.add_argument("--engine", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="engine settings for the header (block_size=16 num_blocks=512 ...); "
                   "values are JSON, else strings")
    p.add_argument("--tokenizer", default="smollm2", metavar="MODEL",
                   help="whose tokenizer counts prompt tokens (a name, .gguf or folder)")


def _add_convert(sub: Any) -> None:
    p = sub.add_parser("convert", help="an Azure LLM inference trace CSV -> a virtual-clock "
                       "trace", description="TIMESTAMP,ContextTokens,GeneratedTokens rows -> "
                       "/v1/completions requests with prompts of exactly ContextTokens tokens")
    p.add_argument("csv", type=flags.input_file, metavar="CSV")
    _common(p)
    p.add_argument("--limit", type=flags.positive_int, metavar="N", help="at most N requests")
    p.add_argument("--start-offset-s", type=flags.non_negative_float, default=0.0, metavar="X",
                   help="skip the rows before X seconds after the first")
    p.add_argument("--model", default="stub", help="the header's and bodies' model name")
    p.add_argument("--stream", action="store_true", help="streaming requests")
    p.add_argument("--seed", type=flags.int64, default=0,
                   help="seed of the synthesised prompt text")
    p.set_defaults(main=guarded(_written(_run_convert)))


def _add_load(sub: Any) -> None:
    p = sub.add_parser("load", help="a synthetic virtual-clock trace",
                       description="A synthetic virtual-clock trace, from --load SPEC and/or "
                       "the flags below (a flag wins over the same key in SPEC). E.g. --load "
                       "n=200,arrival=poisson,rate=4,prompt=uniform:32:512,output=fixed:64",
                       epilog=load_spec.KEYS_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(p)
    p.add_argument("--load", metavar="SPEC", help="key=value,key=value,...")
    for flag, key in _LOAD_FLAGS.items():
        p.add_argument(flag, dest=key, metavar=key.upper())
    p.add_argument("--stream", action="store_const", const="true", help="streaming requests")
    p.add_argument("--note", help="the header's note [sim load SPEC]")
    p.set_defaults(main=guarded(_written(_run_load)))


def _run_convert(a: argparse.Namespace) -> int:
    engine = engine_overrides(a.engine)  # before the slow steps: fail fast on a typo
    rows = read_azure_csv(a.csv)
    trace = convert_azure(rows, tokenizer(a.tokenizer), source=Path(a.csv).name,
                          limit=a.limit, start_offset_s=a.start_offset_s, model=a.model,
                          stream=a.stream, seed=a.seed, engine=engine)
    write_trace(trace, a.out)
    return len(trace.requests)


def _written(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A command that writes a trace of `run(args)` requests, reporting where."""

    def main(a: argparse.Namespace) -> int:
        print(f"wrote {run(a)} requests to {a.out}")
        return 0

    return main


def _run_load(a: argparse.Namespace) -> int:
    engine = engine_overrides(a.engine)
    pairs = split_load_spec(a.load or "")
    for key in [*_LOAD_FLAGS.values(), "stream"]:
        value = getattr(a, key)
        if value is not None:
            pairs[key] = value
    spec = load_spec_from_pairs(pairs)
    trace = generate_load(spec, tokenizer(a.tokenizer), engine=engine, note=a.note)
    write_trace(trace, a.out)
    return len(trace.requests)


if __name__ == "__main__":
    sys.exit(main())
