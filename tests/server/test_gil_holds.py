"""A heavy request's work lets the GIL go while it runs, wherever one C call would hold it
for the whole request: the server does this work in a worker thread (server/offload.py),
and a worker holding the GIL stalls the event loop and the step thread as surely as the
loop doing the work itself.

test_no_stall.py measures the streams a real server keeps beside a heavy body, against
the issue's 100 ms; a call that holds the GIL for 50-70 ms fails that bound only most of
the time. Here the measure is the call's own: while it runs, another thread sleeps 0.1 ms
at a time and its longest wait for the GIL is set against the call's duration. A call that
holds the GIL throughout makes the watcher wait 0.95-0.98 of its length (the regular
expression nesting.py once used: 65 of 68 ms; tokenizers' single `encode`: 553 of 562 ms),
one that lets it go a tenth or less (numpy's passes: 1.9 of 21 ms; the batch encode: 7 of
300 ms). A ratio, not a duration, so a slower host moves both sides.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from support.heavy_bodies import tools_body
from support.server_harness import make_engine

from nanoserve.server.body import nesting
from nanoserve.server.offload import BUSY_SWITCH_INTERVAL_S

TRIES = 3  # the best of three: the host may deschedule the watcher; a held GIL never lets go
SHARE = 0.5  # the longest wait's most, as a share of the call


@pytest.fixture
def busy_interval() -> Iterator[None]:
    """The switch interval the server runs request work under."""
    idle = sys.getswitchinterval()
    sys.setswitchinterval(BUSY_SWITCH_INTERVAL_S)
    yield
    sys.setswitchinterval(idle)


def wait_share(call: Callable[[], object]) -> tuple[float, float]:
    """The longest wait of a thread that sleeps 0.1 ms at a time while `call` runs, as a
    share of the call's duration; and the duration."""
    done = threading.Event()
    waits: list[float] = []

    def watch() -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            time.sleep(0.0001)
            waits.append(time.perf_counter() - t0)

    watcher = threading.Thread(target=watch)
    watcher.start()
    while not waits:  # the watcher is running before the call starts
        time.sleep(0.001)
    t0 = time.perf_counter()
    call()
    took = time.perf_counter() - t0
    done.set()
    watcher.join()
    return max(waits) / took, took


def lets_go(call: Callable[[], object]) -> None:
    shares = []
    for _ in range(TRIES):
        share, took = wait_share(call)
        shares.append(f"{share:.2f} of {took * 1e3:.0f} ms")
        if share < SHARE:
            return
    raise AssertionError(f"the GIL was held: the watcher's longest wait {', '.join(shares)}")


@pytest.mark.usefixtures("busy_interval")
def test_the_nesting_measure_lets_the_gil_go() -> None:
    raw = json.dumps(tools_body(10_000)).encode()  # 2.5 MB
    assert nesting.too_deep(raw) is False
    lets_go(lambda: nesting.too_deep(raw))


@pytest.mark.usefixtures("busy_interval")
def test_tokenizing_lets_the_gil_go() -> None:
    tokenizer = make_engine().tokenizer
    text = "word " * 200_000  # 1 MB
    assert len(tokenizer.encode(text)) == 200_001  # a word a token, and the last space
    lets_go(lambda: tokenizer.encode(text))


@pytest.mark.usefixtures("busy_interval")
def test_the_watcher_sees_a_held_gil() -> None:
    """The measure's own teeth: a regular expression over the same body, one C call that
    never lets go, fails it."""
    raw = json.dumps(tools_body(10_000)).encode()
    with pytest.raises(AssertionError, match="the GIL was held"):
        lets_go(lambda: nesting._TOKEN.findall(raw))
