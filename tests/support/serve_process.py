"""`nanoserve serve` in a process of its own, on a free port, for the tests whose client must
meet the server as a user's would: the command line, a real socket, nothing shared.

    with serving(["--model", "stub"]) as url:   # http://127.0.0.1:PORT, once the engine is ready

Its stderr is read to the end on a thread (a full pipe would block the server's logging); on
exit the server is terminated and the log must hold no traceback.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

ROOT = Path(__file__).resolve().parents[2]


def _drain(stream: TextIO, log: list[str]) -> None:
    log.extend(stream)


@contextmanager
def serving(args: Sequence[str]) -> Iterator[str]:
    cmd = [sys.executable, "-m", "nanoserve.cli", "serve", *args, "--port", "0"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True)
    assert proc.stderr is not None
    log: list[str] = []
    url = None
    try:
        for line in proc.stderr:
            log.append(line)
            m = re.search(r"listening on (http://\S+)", line)
            url = m.group(1) if m else url
            if url and "engine ready" in line:
                break
        else:
            raise AssertionError("serve exited before it was ready:\n" + "".join(log))
        threading.Thread(target=_drain, args=(proc.stderr, log), daemon=True).start()
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert not any("Traceback" in line for line in log), "".join(log)
