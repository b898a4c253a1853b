"""Rank 0's watch over the other ranks: a thread, for as long as the group runs.

A rank is lost in one of two ways: its process exits (a crash, a kill), or it goes silent,
its heartbeat (worker.py) standing still for `timeout_s` (stopped by SIGSTOP, or starved of
the CPU). Either way the watch kills every worker, with SIGKILL, the one signal a stopped
process does not hold back: a survivor may sit in a collective that waits for the lost rank
(gloo tells of a closed connection only the ranks that talk to it, and a stopped rank's
connections never close), so rank 0's own collective or wait for acks fails at once, not at
the process group's timeout. Then it tells its listeners (`on_lost`), which reach the
serving bridge even when no step is running: /health turns 503 on an idle server too.

Before this, a stopped rank was noticed when the process group's timeout (60 s) expired,
and a rank killed while idle when the next request failed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from nanoserve.model.parallel.launch import Rank

log = logging.getLogger(__name__)


class Watch:
    def __init__(self, beats: memoryview, timeout_s: float) -> None:
        self.ranks: list[Rank] = []  # set before start()
        self.beats = beats
        self.timeout_s = timeout_s
        self.lost: str | None = None
        self._listeners: list[Callable[[str], None]] = []
        self._lock = threading.Lock()  # the listeners, and the moment of loss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nanoserve-tp-watch",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def on_lost(self, fn: Callable[[str], None]) -> None:
        """Call fn(reason), once, from the watch's thread when a rank is lost (at once,
        here, if one already is)."""
        with self._lock:
            lost = self.lost
            if lost is None:
                self._listeners.append(fn)
        if lost is not None:
            fn(lost)

    def stop(self) -> None:
        """Quiet from now on: the ranks are being stopped on purpose."""
        self._stop.set()

    def _run(self) -> None:
        period = min(0.1, self.timeout_s / 10)
        last = [self.beats[r.rank] for r in self.ranks]
        now = prev = time.monotonic()
        seen = [now] * len(self.ranks)  # when each rank's beat last moved
        while not self._stop.wait(period):
            now = time.monotonic()
            if now - prev > self.timeout_s / 2:
                # This thread itself went unscheduled (the host suspended, or rank 0 was
                # stopped): that gap says nothing of the ranks' silence.
                seen = [now] * len(self.ranks)
            prev = now
            reason = self._exited()
            for i, r in enumerate(self.ranks):
                beat = self.beats[r.rank]
                if beat != last[i]:
                    last[i], seen[i] = beat, now
                elif reason is None and now - seen[i] > self.timeout_s:
                    reason = (f"rank {r.rank} (pid {r.pid}) stopped answering: no heartbeat "
                              f"for {self.timeout_s:g} s")
            if reason is not None and not self._stop.is_set():
                self._lose(reason)
                return

    def _exited(self) -> str | None:
        gone = [f"rank {r.rank} (pid {r.pid}) exited with code {r.exitcode}"
                for r in self.ranks if r.exitcode is not None]
        return "; ".join(gone) or None

    def _lose(self, reason: str) -> None:
        log.error("tensor parallel: %s; stopping the other ranks", reason)
        for r in self.ranks:
            r.kill()
        for r in self.ranks:
            r.join(1.0)  # reaped: no zombie waits for the server's exit
        with self._lock:
            self.lost = reason
            listeners, self._listeners = self._listeners, []
        for fn in listeners:
            try:
                fn(reason)
            except Exception:  # one listener's bug must not keep the news from the others
                log.exception("on_lost listener %r failed", fn)
