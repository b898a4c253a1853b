"""The `--target` half of `sim replay`'s command line (sim/replay/replay_command.py adds the flags):
run the checks at a server, print the table, write `--report` (JSON, and the table beside
it as FILE.txt). Exit status: 0 when no check failed, 1 when one did, 2 when the target or a
trace cannot be used at all.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import httpx
import trio

from nanoserve import flags
from sim.files import atomic_open
from sim.target.run import run
from sim.trace.loader import TraceError, load_trace


def add_flags(p: Any) -> None:
    g = p.add_argument_group("at another server (--target)")
    g.add_argument("--target", metavar="URL",
                   help="replay at a running OpenAI-compatible server and check what a "
                   "client can see (stream = unary, UTF-8, stop strings, usage, hang-ups, "
                   "slow readers, bad input) instead of replaying through nanoserve's app")
    g.add_argument("--scenarios", action="store_true",
                   help="with --target: run the built-in checks (no trace needed)")
    g.add_argument("--report", type=flags.output_file, metavar="FILE",
                   help="with --target: write the report as JSON (and FILE.txt, the table)")
    g.add_argument("--step-seconds", type=flags.positive_float, default=0.05, metavar="S",
                   help="with --target: seconds a trace's step stands for [0.05]")
    g.add_argument("--settle", type=flags.positive_float, default=10.0, metavar="S",
                   help="with --target: seconds a hung-up request may stay running [10]")
    g.add_argument("--extra-body", type=_json_object, default={}, metavar="JSON",
                   help="with --target: fields added to every generation request, e.g. "
                   "'{\"cache_prompt\": false}' for llama-server")
    g.add_argument("--slots", type=flags.positive_int, metavar="N",
                   help="with --target: requests the server runs at once; where it exports "
                   "no running-requests gauge, the hang-up check fills N slots and times a "
                   "request queued behind them")
    g.add_argument("--api-key", metavar="KEY",
                   help="with --target: sent as `Authorization: Bearer KEY` on every request")
    g.add_argument("--slow-window", type=flags.positive_float, default=20.0, metavar="S",
                   help="with --target: seconds fast streams run beside slow readers, and "
                   "beside eager ones [20]")


def _json_object(text: str) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return obj


def main(a: argparse.Namespace) -> int:
    if not (a.scenarios or a.traces):
        print("sim replay --target: give traces, --scenarios, or both", file=sys.stderr)
        return 2
    named = []
    for path in a.traces:
        try:
            named.append((Path(path), load_trace(Path(path))))
        except (TraceError, OSError) as exc:
            print(f"sim replay: {path}: {exc}", file=sys.stderr)
            return 2
    try:
        report = trio.run(lambda: run(a.target, named, scenarios=a.scenarios,
                                      step_s=a.step_seconds, settle_s=a.settle,
                                      window_s=a.slow_window, extra=a.extra_body,
                                      slots=a.slots, api_key=a.api_key))
    except httpx.HTTPError as exc:
        print(f"sim replay: {a.target}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(report.table())
    if a.report:
        with atomic_open(Path(a.report)) as f:
            f.write(report.dumps())
        with atomic_open(Path(a.report + ".txt")) as f:
            f.write(report.table() + "\n")
    return 1 if report.failed else 0
