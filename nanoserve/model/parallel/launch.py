"""Starting a rank: a fresh interpreter on the worker's own entry point.

Not multiprocessing's "spawn": a spawned child re-imports the parent's `__main__` module
to find its target, so a script without an `if __name__ == "__main__":` guard (the shape
of vLLM's own offline quickstart) runs again in every rank, and there tries to start ranks
of its own, which multiprocessing stops with "An attempt has been made to start a new
process before the current process has finished its bootstrapping phase". Nor "fork": the
parent may already run threads (the server's event loop, torch's pools) that a forked
child would inherit half-held. vLLM forks its CPU workers where it safely can and spawns
elsewhere; a child started by subprocess as `python -m nanoserve.model.parallel` runs only
nanoserve's code, whatever the parent's script looks like.

What the child needs, a `Boot` (worker.py), comes down its stdin, length-prefixed and
pickled; the same
pipe then carries the channel's wake-ups (parallel/channel.py), and its end-of-file tells
the worker that rank 0 is gone. The child inherits stdout and stderr (its log lines join
the server's) and the environment, with nanoserve's own folder first on PYTHONPATH so that
a source checkout that is not installed still imports.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import IO

from nanoserve.model.parallel.worker import Boot, encode_boot


class Rank:
    """One worker process (rank >= 1), as rank 0 sees it."""

    def __init__(self, boot: Boot) -> None:
        self.rank = boot.rank
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[3])  # the folder holding `nanoserve/`
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen([sys.executable, "-m", "nanoserve.model.parallel"],
                                     stdin=subprocess.PIPE, env=env)
        stdin: IO[bytes] | None = self.proc.stdin
        assert stdin is not None
        self.stdin = stdin
        # A few hundred bytes: the pipe's buffer takes them before the child reads.
        stdin.write(encode_boot(boot))
        stdin.flush()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def wake_fd(self) -> int:
        return self.stdin.fileno()

    @property
    def exitcode(self) -> int | None:
        """None while it runs; its exit status (a negative signal number if killed)."""
        return self.proc.poll()

    def kill(self) -> None:
        """SIGKILL: the one signal a stopped process cannot hold back."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()

    def join(self, timeout_s: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout_s)

    def close_pipe(self) -> None:
        with contextlib.suppress(OSError):
            self.stdin.close()
