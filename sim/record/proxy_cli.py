"""`sim record --upstream URL --out TRACE [--host H] [--port P] [--engine KEY=VALUE ...]`:
the recording proxy (upstream.py) on a Hypercorn socket, until SIGINT or SIGTERM; then the
trace is written (until then the file is a journal of the exchanges that ended: a kill
keeps them). Exit status 0; 1 when an exchange could not be journaled (logged with its
id); 2 when the upstream cannot be reached at the start or the trace cannot be written.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any

import httpx
import trio

from nanoserve import flags
from sim.cli_util import engine_overrides
from sim.http.loopback import hypercorn_on_loopback
from sim.load.azure import ConvertError, default_engine
from sim.record.upstream import Proxy
from sim.target.wire import first_model
from sim.trace.format import TraceHeader
from sim.trace.journal import INCOMPLETE, JournalWriter
from sim.trace.write import dumps_line, header_object, write_trace


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "record", help="a recording proxy in front of any OpenAI-compatible server",
        description="Forwards every request to --upstream unchanged and writes the "
        "generation requests (arrivals, bodies, hang-ups, slow readers, the answers) as a "
        "virtual-clock trace when stopped (SIGINT or SIGTERM).")
    p.add_argument("--upstream", required=True, metavar="URL")
    p.add_argument("--out", required=True, type=flags.output_file, metavar="TRACE")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001, help="0: a free port [8001]")
    p.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                   help="the header's engine settings (default: EngineConfig's)")
    p.set_defaults(main=_main)


def _main(a: argparse.Namespace) -> int:
    try:
        engine = default_engine(engine_overrides(a.engine))
    except (ValueError, ConvertError) as exc:
        print(f"sim record: {exc}", file=sys.stderr)
        return 2
    return trio.run(_run, a, engine)


async def _run(a: argparse.Namespace, engine: dict[str, Any]) -> int:
    upstream = a.upstream.rstrip("/")
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                                 limits=httpx.Limits(max_connections=None)) as client:
        try:
            r = await client.get(upstream + "/v1/models")
        except httpx.HTTPError as exc:
            print(f"sim record: {upstream}: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 2
        model = first_model(r.content) or "default"
        note = f"recorded by sim record --upstream {upstream}"
        header = TraceHeader("virtual", model, engine, note=note)
        journal = JournalWriter(Path(a.out))
        journal.write(dumps_line({**header_object(header),
                                  INCOMPLETE: "sim record was still running"}))
        proxy = Proxy(upstream, client, journal)
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with hypercorn_on_loopback(proxy, bind=[f"{a.host}:{a.port}"]) as url:
                print(f"sim record: listening on {url}, forwarding to {upstream}",
                      file=sys.stderr, flush=True)
                async for _ in signals:
                    break
    journal.close()
    try:
        write_trace(proxy.trace(model, engine, note), a.out)
    except Exception as exc:  # a session's recording: say why it was lost, never a traceback
        print(f"sim record: {a.out}: {exc}", file=sys.stderr)
        return 2
    print(f"sim record: {len(proxy.exchanges)} requests written to {a.out}", file=sys.stderr)
    return 1 if proxy.failed else 0
