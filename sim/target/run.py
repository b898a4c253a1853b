"""`sim replay --target URL [--scenarios] [TRACE...]`: the checks run at a server we do not
control, gathered into one report.

The built-in scenarios (checks.py, load.py) need no trace: stream against unary, UTF-8 in
the frames, stop strings, usage, hang-ups, slow readers, bad input. Each trace adds its own
checks (traces.py), named with the trace's file name. Checks run one after another, so that
one check's load does not move another's figures.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from sim.target import checks, load, pacing, traces, wire
from sim.target.outcome import Outcome, Report
from sim.target.target import Target
from sim.trace.format import Trace

Check = Callable[[Target], Awaitable[Outcome]]

SCENARIOS: tuple[Check, ...] = (
    checks.stream_equals_unary, checks.utf8_frames, checks.stop_strings, checks.usage,
    load.hangup_frees_slot, pacing.slow_readers, checks.bad_input,
)


async def run(url: str, named_traces: Sequence[tuple[Path, Trace]], *, scenarios: bool,
              step_s: float = 0.05, settle_s: float = 10.0, window_s: float = 20.0,
              extra: dict[str, Any] | None = None, slots: int | None = None,
              api_key: str | None = None) -> Report:
    url = url.rstrip("/")
    async with wire.make_client(api_key) as cl:
        t = Target(url, cl, "", settle_s=settle_s, window_s=window_s, extra=dict(extra or {}),
                   slots=slots, api_key=api_key)
        ident = await checks.identity(t)
        t.model = str(ident.get("model") or "default")
        report = Report(url, ident)
        for check in SCENARIOS if scenarios else ():
            report.outcomes += await guarded(check.__name__, functools.partial(check, t))
        for path, trace in named_traces:
            why = traces.unsupported(trace)
            if why is not None:
                report.outcomes.append(Outcome(f"trace {path.name}", "unsupported", why))
                continue
            for o in await guarded(f"trace {path.name}",
                                   functools.partial(traces.replay_at, t, trace, step_s)):
                report.outcomes.append(Outcome(f"{o.check} ({path.name})", o.status, o.detail,
                                               o.evidence))
        return report


async def guarded(name: str, check: Callable[[], Awaitable[Outcome | list[Outcome]]]
                  ) -> list[Outcome]:
    """The check's outcomes; where the server's answers broke the harness itself (a shape
    it did not expect, a connection that failed mid-check), one `fail` saying so, so that
    the other checks still run and the report is still written."""
    try:
        got = await check()
    except Exception as exc:  # any error here is the server's answers meeting a gap in ours
        where = "".join(traceback.format_exception(exc)[-3:])
        return [Outcome(name, "fail", f"the check could not finish: {type(exc).__name__}: "
                        f"{exc}"[:300], ({"traceback": where},))]
    return got if isinstance(got, list) else [got]
