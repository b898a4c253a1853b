"""`sim replay TRACE... [--model stub|smollm2|PATH] [--out RESULT] [--update] [--no-twin]
[--cost FILE] [--tensor-parallel-size N]`: the command line of `sim.replay.run`; with
`--target URL [--scenarios] [--report FILE]`, of sim.target (the checks at another server).

Each trace prints its mismatches, one line each (prefixed by the trace's path when several
are given), or one summary line when it replays clean. Exit status: 0 when every trace is
clean, 1 when any has a mismatch, 2 when a trace cannot be replayed at all (malformed, a
header setting replay cannot honour, weights that do not load).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from nanoserve import flags
from nanoserve.model.base import ModelStartError
from sim.files import atomic_open
from sim.replay.run import ReplayError, ReplayResult, replay
from sim.target import target_command
from sim.trace.loader import TraceError, load_trace
from sim.trace.write import write_trace


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "replay", help="replay traces through the real server and check them",
        description="Replays each trace through nanoserve's own app in process, on the step "
        "(or virtual) clock, and checks its expectation lines, the invariants of "
        "docs/ARCHITECTURE.md and, unless --no-twin, the stream/unary twin.")
    p.add_argument("traces", nargs="*", metavar="TRACE")
    p.add_argument("--model", default=None, metavar="stub|smollm2|PATH",
                   help="weights to replay on (default: the header's); on other weights "
                   "only the invariants and the twin are checked")
    p.add_argument("--out", type=flags.output_file, metavar="RESULT",
                   help="write the observed outcome as "
                   "expectation lines (one trace only)")
    p.add_argument("--update", action="store_true",
                   help="rewrite each trace's expectation lines with what was observed")
    p.add_argument("--no-twin", dest="twin", action="store_false",
                   help="skip the second run with streams and unary requests swapped")
    p.add_argument("--tensor-parallel-size", "-tp", type=flags.positive_int, default=1,
                   metavar="N",
                   help="shard the weights over N processes (nanoserve serve's flag) [1]")
    p.add_argument("--cost", type=flags.input_file, metavar="FILE",
                   help="step-cost model for virtual-clock traces "
                   "(default: the header's cost_model, else a constant per step)")
    target_command.add_flags(p)
    p.set_defaults(main=_main)


def _main(a: argparse.Namespace) -> int:
    if a.target:
        return target_command.main(a)
    if a.scenarios or a.report:
        print("sim replay: --scenarios and --report go with --target", file=sys.stderr)
        return 2
    if not a.traces:
        print("sim replay: give at least one trace", file=sys.stderr)
        return 2
    if a.out and len(a.traces) != 1:
        print("sim replay: --out takes one trace", file=sys.stderr)
        return 2
    worst = 0
    for path in a.traces:
        prefix = f"{path}: " if len(a.traces) > 1 else ""
        try:
            worst = max(worst, _one(Path(path), a, prefix))
        except (TraceError, ReplayError, OSError, ModelStartError) as exc:
            print(f"sim replay: {path}: {exc}", file=sys.stderr)
            worst = 2
    return worst


def _one(path: Path, a: argparse.Namespace, prefix: str) -> int:
    trace = load_trace(path)
    if a.update and a.model is not None and a.model != trace.header.model:
        print(f"{prefix}not updated: --model differs from the header's model", file=sys.stderr)
        return 2
    # --update checks only invariants and the twin: the old expectations are being replaced.
    check = False if a.update else None
    result = replay(trace, model=a.model, twin=a.twin, cost=a.cost, check_expectations=check,
                    tensor_parallel_size=a.tensor_parallel_size)
    for w in result.warnings:
        print(f"{prefix}warning: {w}", file=sys.stderr)
    for line in result.mismatches:
        print(prefix + line)
    if a.out:
        _write_expectations(result, Path(a.out))
    if a.update:
        if not result.ok:
            print(f"{prefix}not updated: the replay broke an invariant", file=sys.stderr)
            return 1
        write_trace(dataclasses.replace(trace, expectations=tuple(result.expectations())),
                    path)
        print(f"{prefix}updated: {result.summary()}")
        return 0
    if result.ok:
        checked = "" if result.expectations_checked else " (invariants and twin only)"
        print(f"{prefix}ok: {result.summary()}{checked}")
        return 0
    return 1


def _write_expectations(result: ReplayResult, out: Path) -> None:
    with atomic_open(out) as f:
        for e in result.expectations():
            f.write(json.dumps({"expect": e.id, **e.fields}, ensure_ascii=False) + "\n")
