"""Request-sized work off the event loop.

Parsing a body, validating it, rendering the chat template, tokenizing and compiling a
grammar all grow with the request: on the event loop, a 1.7 MB body of 10,000 tools held
every other stream and /health for 34 seconds. Each route hands that work to `Offload.run`,
which runs a large body's in a worker thread under a small limiter shared by the app, so the
loop keeps serving while it runs. Python's GIL still lets one thread run at a time, but it
switches every few milliseconds (sys.getswitchinterval), which is the stall a heavy request
now costs its neighbours instead of its whole duration. The limiter is small for the same
reason: more threads only queue for the GIL, and the engine's step thread must still get its
turn.

The other stall a big request causes is the garbage collector's: the objects it allocates
start a collection of the oldest generation, which walks every object in the process (the
model's, torch's: over 100 ms) while holding the GIL, in whichever thread allocated.
`freeze_heap`, once the engine is loaded, moves what exists then out of the collector's
sight (gc.freeze, as vLLM does after its startup), so a collection walks only what requests
made since. Measured with 2,000 tools beside eight streams: a 115 ms pause in the worker
thread, every other thread waiting on the GIL, without it. What requests make is still
walked: a body of 10,000 tools (2.5 MB, the limits raised) parsed, validated and rendered
is a million objects, and full collections in its worker took 40-128 ms, each time with
nothing to free (the body is a tree; its reference counts free it). So while request work
is in flight, full collections wait (the oldest generation's threshold raised; the young
ones still run, 6-8 ms at most there): once the work is done, its objects are gone and
the next collection walks only what lives on. With the hold, that body's longest GIL hold
in the worker was 16 ms. Where work never stops coming, they wait MAX_HOLD_S at most.

And the GIL's convoy: a thread that gives the GIL up for a syscall (the loop's socket
writes) or a torch op (every op of the engine's step) waits the switch interval, 5 ms, to
get it back from a worker running pure Python, once per op. A step of a few dozen small
ops then takes 100 ms. While request work is in flight the interval is 0.1 ms, so the wait
is a fiftieth; the heavy request pays the extra switches, not its neighbours. Measured beside
eight streams of the stub, 1,000 tools, three runs each on a shared two-core machine: the
streams' worst gap 150-270, 50-120 and 90-130 ms at 5 ms; 50-90, 40-70 and 65-105 ms at
0.5 ms. Later, over the median gap, four runs at 0.1 ms against three at 0.5 ms: 48-85
against 61-119 ms, the heavy request 1.6 s against 1.0 s. The interval is the process's,
so the count of work in flight is too.

A small body's work stays on the loop. Handing it to a thread is not free where the step
thread and its OpenMP worker hold both cores: the worker must win the GIL and a core, and the
loop waits for it to hand the result back. At 16 streams of 128-token prompts (SmolLM2 on a
2-vCPU Zen 3, `python -m sim.bench.online --n 64`, runs taking turns, 2026-12-08), every
body in a thread gave 115.7-158.4 output tok/s (median 135.9, eleven runs), every body
inline 141.1-164.3 (median 160.0, five runs), and the server before the offload (8c97eeb)
137.5-155.8 in the same rounds (median 148.7, eleven runs). With INLINE_BYTES' rule,
123.8-178.7 (median 157.1, eight runs) against 143.9-168.4 before (median 155.8, the same
rounds). A body under INLINE_BYTES is parsed, rendered and tokenized in
a few milliseconds (a chat body of 65 tools, 16 KB, on the stub: 3.9-4.6 ms), the stall a
step's own Python already is; the bodies that stalled the loop for hundreds of milliseconds
(1,000 tools, a 1 MB input) are far above it.

Only the live clock gets threads. The step, virtual and gate clocks promise that a run is a
pure function of its trace (bridge/clock.py): a thread would let a request reach the inbox
at a moment the scheduler chose, and an autojump clock leap ahead while it ran. There the
work runs inline, as it always did, and a replay stays byte for byte what it was.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable
from typing import TypeVar

import trio

T = TypeVar("T")

# The GIL's switch interval while request work runs in a thread; Python's default is 5 ms.
BUSY_SWITCH_INTERVAL_S = 0.0001
# The oldest generation's threshold then: its collections wait until no work is in flight,
# or MAX_HOLD_S at most.
NO_FULL_COLLECTION = 2**31 - 1
MAX_HOLD_S = 5.0
# Bodies smaller than this run their work inline on the loop (the module's docstring).
INLINE_BYTES = 16 << 10


class _Busy:
    """Request work in flight in this process, across apps: the first in lowers the switch
    interval and holds back full collections, the last out puts back what it found. Only
    Trio threads touch it (one loop per app, each its own Trio thread), so the count's
    updates come one at a time under the GIL."""

    in_flight = 0
    idle_interval = 0.005
    idle_thresholds = (700, 10, 10)
    held_since: float | None = None  # when full collections were held back, if they are

    @classmethod
    def enter(cls) -> None:
        if cls.in_flight == 0:
            cls.idle_interval = sys.getswitchinterval()
            sys.setswitchinterval(min(cls.idle_interval, BUSY_SWITCH_INTERVAL_S))
            cls.idle_thresholds = gc.get_threshold()
            young, middle, _ = cls.idle_thresholds
            gc.set_threshold(young, middle, NO_FULL_COLLECTION)
            cls.held_since = time.monotonic()
        cls.in_flight += 1

    @classmethod
    def leave(cls) -> None:
        cls.in_flight -= 1
        if cls.in_flight == 0:
            sys.setswitchinterval(cls.idle_interval)
        since = cls.held_since
        if since is not None and (cls.in_flight == 0 or time.monotonic() - since > MAX_HOLD_S):
            # Where work never stops coming, collections resume after MAX_HOLD_S: a cycle
            # that dies in the oldest generation is freed only by one.
            gc.set_threshold(*cls.idle_thresholds)
            cls.held_since = None


class Offload:
    def __init__(self, threads: int | None) -> None:
        """`threads`: how many run at once; None runs the work inline (a replay's clocks)."""
        if threads is not None and threads < 1:
            raise ValueError(f"request_threads must be at least 1, got {threads}")
        self._threads = threads
        self._limiter: trio.CapacityLimiter | None = None  # made in the run, on first use

    @property
    def threaded(self) -> bool:
        return self._threads is not None

    async def run(self, fn: Callable[[], T], body_bytes: int) -> T:
        """`fn()`, the work of a body of `body_bytes`: in a worker thread when threaded and
        the body is INLINE_BYTES or more, else inline. Not abandoned on cancellation: `fn`
        only reads shared state (Engine.prepare is safe beside a step), so a client that
        leaves costs the rest of its work, which the limits bound (body/limits.py)."""
        if self._threads is None or body_bytes < INLINE_BYTES:
            return fn()
        if self._limiter is None:
            self._limiter = trio.CapacityLimiter(self._threads)
        _Busy.enter()
        try:
            return await trio.to_thread.run_sync(fn, limiter=self._limiter)
        finally:
            _Busy.leave()


def freeze_heap() -> None:
    """Collect, then hide every object left from the oldest generation's collections: the
    loaded model and libraries live as long as the process, and walking them is the pause.
    Objects frozen are still freed by their reference counts; only a cycle among them that
    dies later is kept, which a server's startup objects do not form."""
    gc.collect()
    gc.freeze()
