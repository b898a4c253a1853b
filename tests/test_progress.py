"""Progress bars on long offline work: drawn on a terminal, absent in a pipe or with --quiet.

Each command runs as a real process twice: once with its stdout and stderr on a pseudo-
terminal (what a person at a shell sees), once with them on pipes (CI, logs, `| tee`).
"""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GENERATE = ("from nanoserve import LLM, SamplingParams; LLM('stub').generate(['a'] * 8, "
            "SamplingParams(max_tokens=4){})")
COST = str(ROOT / "sim" / "costs" / "smollm2-cpu.json")


def on_pty(argv: list[str]) -> str:
    """Everything `argv` wrote, with stdout and stderr on a pseudo-terminal of 24 x 120
    (a new pty has no size, and tqdm draws nothing in zero columns)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
                            cwd=ROOT)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 1 << 16)
        except OSError:  # EIO: the child has closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=300) == 0, b"".join(chunks).decode(errors="replace")[-2000:]
    return b"".join(chunks).decode(errors="replace")


def on_pipes(argv: list[str]) -> str:
    out = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout + out.stderr


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
    assert bar.split(":")[0] not in on_pipes(argv)
    assert bar.split(":")[0] not in on_pty(quiet_argv)
