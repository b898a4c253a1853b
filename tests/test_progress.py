"""Progress bars on long offline work: drawn on a terminal, absent in a pipe or with --quiet.

Each command runs as a real process with its stdout and stderr on a pseudo-terminal (what a
person at a shell sees), then three times through its main in this process (a process start
is most of a run's seconds): on a pseudo-terminal, where the bar must show as it did in the
process (so the two runs below see what the command draws), on a pipe (CI, logs, `| tee`),
and quiet on a pseudo-terminal.
"""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path
from unittest import mock

import pytest

from nanoserve import cli as nanoserve_cli
from sim import commands as sim_cli

ROOT = Path(__file__).resolve().parents[1]
GENERATE = ("from nanoserve import LLM, SamplingParams; LLM('stub').generate(['a'] * 8, "
            "SamplingParams(max_tokens=4){})")
COST = str(ROOT / "sim" / "costs" / "smollm2-cpu.json")


def open_pty() -> tuple[int, int]:
    """A pseudo-terminal of 24 x 120 (a new pty has no size, and tqdm draws nothing in zero
    columns): (master, slave)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    return master, slave


def read_all(fd: int, into: list[bytes]) -> None:
    """Read `fd` to its end: EOF, or EIO once a terminal's last writer has closed it."""
    while True:
        try:
            data = os.read(fd, 1 << 16)
        except OSError:
            return
        if not data:
            return
        into.append(data)


def on_pty(argv: list[str]) -> str:
    """Everything `argv` wrote as a process with stdout and stderr on a pseudo-terminal."""
    master, slave = open_pty()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
                            cwd=ROOT)
    os.close(slave)
    chunks: list[bytes] = []
    read_all(master, chunks)
    os.close(master)
    assert proc.wait(timeout=300) == 0, b"".join(chunks).decode(errors="replace")[-2000:]
    return b"".join(chunks).decode(errors="replace")


def in_process(argv: list[str], *, terminal: bool) -> str:
    """Everything `argv` (one of the command lines above) wrote when run through its main in
    this process, sys.stdout and sys.stderr on a pseudo-terminal or on a pipe; a reader
    thread drains it, so a full pipe never blocks the command."""
    read_end, write_end = open_pty() if terminal else os.pipe()
    chunks: list[bytes] = []
    reader = threading.Thread(target=read_all, args=(read_end, chunks))
    reader.start()
    with os.fdopen(write_end, "w", buffering=1) as out, \
            mock.patch.object(sys, "stdout", out), mock.patch.object(sys, "stderr", out):
        if argv[1] == "-c":
            exec(argv[2], {})  # noqa: S102  (GENERATE, this file's own code)
            code = 0
        else:
            code = {"nanoserve.cli": nanoserve_cli.main, "sim.commands": sim_cli.main}[
                argv[2]](argv[3:])
    reader.join(timeout=60)
    os.close(read_end)
    text = b"".join(chunks).decode(errors="replace")
    assert code == 0, text[-2000:]
    return text


def sim(*args: str) -> list[str]:
    return [sys.executable, "-m", "sim.commands", *args]


@pytest.mark.parametrize(("argv", "bar", "quiet"), [
    pytest.param([sys.executable, "-c", GENERATE.format("")], "Processed prompts: 100%",
                 [sys.executable, "-c", GENERATE.format(", use_tqdm=False")], id="LLM.generate"),
    pytest.param([sys.executable, "-m", "nanoserve.cli", "bench", "--model", "stub", "--n", "6",
                  "--out-max", "20"], "Processed prompts: 100%", ["--quiet"], id="bench"),
    pytest.param(sim("capacity", "--load", "n=40,rate=5,prompt=fixed:16,output=fixed:8",
                     "--cost", COST, "--no-plots", "--out", "{tmp}/cap"),
                 "rate=5 blocks=", ["--quiet"], id="sim capacity"),
    pytest.param(sim("profile", "--model", "stub", "--quick", "--reps", "1", "--out",
                     "{tmp}/cost.json"), "sim profile: 100%", ["--quiet"], id="sim profile"),
    pytest.param(sim("validate", "--model", "stub", "--runs", "1", "--cost", COST, "--load",
                     "n=6,rate=50,prompt=fixed:8,output=fixed:4"),
                 "sim validate: run 1/1: 100%", ["--quiet"], id="sim validate"),
])  # fmt: skip
def test_a_bar_on_a_terminal_and_none_in_a_pipe_or_when_quiet(
    argv: list[str], bar: str, quiet: list[str], tmp_path: Path
) -> None:
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    quiet_argv = quiet if quiet[0] == sys.executable else [*argv, *quiet]
    assert bar in on_pty(argv)
    assert bar in in_process(argv, terminal=True)  # this process's terminal shows it too
    assert bar.split(":")[0] not in in_process(argv, terminal=False)
    assert bar.split(":")[0] not in in_process(quiet_argv, terminal=True)
