"""The llama.cpp build that `python -m sim.bench.llamacpp` measures (llamacpp.py): built once by
scripts/build_llamacpp.sh, then probed on the GGUF file, since a native build can die on a
host whose CPU flags list instructions the VM does not enable (SIGILL); `--isa native` then
falls back to the AVX2 build."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path


def build(isa: str) -> Path:
    out = subprocess.run(["bash", "scripts/build_llamacpp.sh", isa], check=True,
                         stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHON": sys.executable})
    return Path(out.stdout.strip().splitlines()[-1])


PROBE_TIMEOUT_S = 600


def probe(bins: Path, gguf: Path) -> str | None:
    """None where the build in `bins` runs `gguf` on this host, else how it fails: a tiny
    `llama-bench` (8 prompt tokens, 1 generated) loads the file and runs the matrix kernels
    the measurements will, so a build with instructions this CPU lacks dies here, not midway."""
    cmd = [str(bins / "llama-bench"), "-m", str(gguf), "-t", "2", "-p", "8", "-n", "1",
           "-r", "1"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"ran past {PROBE_TIMEOUT_S} s on an 8-token probe"
    except OSError as exc:
        return f"could not start ({exc})"
    if done.returncode < 0:
        try:
            name = signal.Signals(-done.returncode).name
        except ValueError:
            name = f"signal {-done.returncode}"
        return f"died with {name}" + (" (an instruction this CPU does not run)"
                                      if name == "SIGILL" else "")
    if done.returncode > 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return f"exited {done.returncode} ({last})"
    return None


def working_build(isa: str, gguf: Path) -> tuple[Path, str, str | None]:
    """The llama.cpp build to measure: (its folder, its ISA, why it is not `isa`'s or None).
    `--isa native` falls back to the AVX2 build where the native one fails to build or dies
    on this host; `--isa avx2` has nothing to fall back to."""
    candidates = (isa, "avx2") if isa == "native" else (isa,)
    failures: list[str] = []
    for b in candidates:
        try:
            bins = build(b)
        except subprocess.CalledProcessError as exc:
            why = f"the {b} build failed (build_llamacpp.sh exited {exc.returncode})"
        else:
            failure = probe(bins, gguf)
            if failure is None:
                return bins, b, "; ".join(failures) or None
            why = f"the {b} build ({bins}) {failure}"
        failures.append(why)
        more = "; using the avx2 build" if b != candidates[-1] else ""
        print(f"llama.cpp: {why}{more}", flush=True)
    raise SystemExit(f"llama.cpp: no build runs on this host: {'; '.join(failures)}")
