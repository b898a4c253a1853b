"""nanoserve's own CPU kernels (model/csrc/*.cpp), compiled on this machine on first use,
once per instruction set, and the run-time choice of which one runs.

The sources build into one shared library per instruction set (native_build.py), each
registering its ops under its own name so that several can be loaded in one process (the
tests run each):

    avx512   AVX-512 F/BW/DQ/VL, FMA, F16C     torch.ops.nanoserve_avx512
    avx2     AVX2, FMA, F16C                   torch.ops.nanoserve_avx2
    generic  the compiler's baseline           torch.ops.nanoserve_generic

Which sets this machine runs (`supported()`, isa_support.py) is decided by what the CPU
advertises and what the OS has enabled; the flags each build is compiled with are exactly
the flags it is chosen by, so one cache, shared between an AVX-512 and an AVX2 machine,
serves both at full speed. Importing this module also holds oneDNN (PyTorch's int8 GEMM)
to what the OS enabled where the CPU lists more (cpu.limit_onednn), before any model runs
it.

`isa()` is NANOSERVE_ISA's set where it names one (`avx2`, `avx512` or `generic`, for tests
and benchmarks; one this machine cannot run is refused with what it lacks, never loaded).
Otherwise (`auto`) the wider set is not taken on trust: on one Intel Xeon the avx512 build
decoded more slowly at batch 1 than the avx2 one. Where the machine runs both, each
multiplies one row by synthetic quantized weights larger than the last-level cache
(isa_timing.py), once per machine: the faster set is kept, the wider one unless the
narrower wins by more than 3%, and the figures are logged. The choice is cached as JSON
beside the libraries (isa_choice.py); processes that start together (a tensor-parallel
group's ranks) measure once, under a file lock.

Without a compiler, or with NANOSERVE_NATIVE=0, the model runs its stock-PyTorch path,
which gives the same tokens more slowly; the reason is logged once.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nanoserve.model import cpu
from nanoserve.model.cache import cache_root
from nanoserve.model.isa_choice import (
    CHOICE_FILE,
    TIE,
    choice_key,
    faster,
    figures,
    read_choice,
    write_choice,
)
from nanoserve.model.isa_support import ISAS, act8_suffix, cpu_flags, pick_isa, supported
from nanoserve.model.isa_timing import decode_weights, time_decode, time_kernels
from nanoserve.model.native_build import STALE_AFTER_S
from nanoserve.model.native_build import build as _build
from nanoserve.model.native_build import find_compiler as _compiler
from nanoserve.model.native_build import library as _library
from nanoserve.model.native_build import prune as _prune  # noqa: F401  (tests: native._prune)

# The kernels' interface, whichever module above holds each part: callers (and the tests)
# import all of it from here.
__all__ = [
    "CHOICE_FILE", "ISAS", "STALE_AFTER_S", "TIE", "Kernels", "act8_suffix", "available",
    "choice_key", "choose_isa", "cpu_flags", "decode_weights", "faster", "isa", "kernels",
    "pick_isa", "supported", "time_decode",
]

log = logging.getLogger(__name__)

# oneDNN reads its ISA cap once, at its first primitive; every path to a model imports this
# module before that (llama.py, weights.py, quant.py), so the cap is set here.
cpu.limit_onednn(cpu.host())


@dataclass(frozen=True, slots=True)
class Kernels:
    """One instruction set's loaded kernels: `ops.quant_linear(...)` and the rest."""

    isa: str
    ops: Any  # torch.ops.nanoserve_<isa>


def isa() -> str:
    """The instruction set the kernels run with here: NANOSERVE_ISA's where it is set, else
    the faster on this machine of those it runs (measured once, then cached)."""
    requested = os.environ.get("NANOSERVE_ISA")
    if requested or os.environ.get("NANOSERVE_NATIVE", "1") == "0":
        return pick_isa(requested)
    return _auto_isa(cache_root())


@functools.cache
def _auto_isa(root: Path) -> str:
    """`auto`'s choice for the kernels cached under `root`, once per process."""
    can = supported()
    candidates = tuple(i for i in can if i != "generic")  # generic never wins
    if len(candidates) < 2:
        return can[0]
    try:
        key = _auto_key(root, candidates)
    except RuntimeError:  # no compiler: no kernels to measure (kernels() says why)
        return can[0]
    return choose_isa(candidates, key, root / "native" / CHOICE_FILE, _measure_decode)


def _auto_key(root: Path, candidates: Sequence[str]) -> str:
    """This machine's key for a choice among `candidates`' builds under `root` (none need
    exist yet: the names are digests of what they would be built from)."""
    compiler = _compiler()
    return choice_key(cpu.host(), [_library(root, i, compiler).name for i in candidates])


def choose_isa(candidates: Sequence[str], key: str, path: Path,
               measure: Callable[[Sequence[str]], Mapping[str, float]]) -> str:
    """The faster of `candidates` (widest first) here: as cached in `path` under `key`, else
    timed by `measure` (seconds by instruction set; a set it could not load left out) and
    cached. A narrower set is taken only where it beats the wider by more than TIE."""
    if len(candidates) < 2:
        return candidates[0]
    cached = read_choice(path, key, candidates)
    if cached is not None:
        return _reuse(*cached, candidates)
    with _locked(path.with_suffix(".lock")):
        cached = read_choice(path, key, candidates)  # measured while this process waited
        if cached is not None:
            return _reuse(*cached, candidates)
        seconds = measure(candidates)
    timed = [c for c in candidates if c in seconds]
    if len(timed) < 2:  # some build failed: nothing to compare, and nothing worth keeping
        return timed[0] if timed else candidates[0]
    chosen = faster(seconds, timed)
    ms = {c: round(seconds[c] * 1e3, 3) for c in timed}
    write_choice(path, key, chosen, ms)
    log.info("nanoserve's CPU kernels: a one-row multiply by quantized weights took %s: "
             "auto runs %s on this CPU (kept in %s)", figures(ms), chosen, path)
    return chosen


def _reuse(chosen: str, ms: Mapping[str, float], candidates: Sequence[str]) -> str:
    log.info("nanoserve's CPU kernels: auto runs %s on this CPU, as measured (%s)", chosen,
             figures({c: ms[c] for c in candidates if c in ms}))
    return chosen


@contextlib.contextmanager
def _locked(lock: Path) -> Iterator[None]:
    """Hold an exclusive lock on the file `lock` (made if need be), so that processes
    starting together (a tensor-parallel group's ranks) measure one at a time, and the
    later ones read the first one's choice rather than each timing under the others' load
    and perhaps choosing apart. Where the file cannot be made (a read-only cache), no lock."""
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _measure_decode(candidates: Sequence[str]) -> dict[str, float]:
    """Seconds of one row through synthetic weights larger than the last-level cache, by
    instruction set; a set whose kernels do not load is left out."""
    ops = {c: k.ops for c in candidates if (k := _load(c)) is not None}
    if len(ops) < 2:
        return {c: 0.0 for c in ops}
    return time_kernels(ops)


@functools.cache
def _load(isa: str) -> Kernels | None:
    try:
        torch.ops.load_library(str(_build(cache_root(), isa)))
    except (OSError, RuntimeError) as e:
        log.warning("native kernels unavailable, using stock PyTorch ops (the %s build): %s",
                    isa, e)
        return None
    ops = getattr(torch.ops, f"nanoserve_{isa}")
    built = ops.isa()
    if built != isa:  # the compiler did not honour the flags: never run it as `isa`
        log.warning("native kernels: the %s build reports %s; using stock PyTorch ops",
                    isa, built)
        return None
    log.info("nanoserve's CPU kernels loaded: %s (this machine runs %s)", isa,
             ", ".join(supported()))
    return Kernels(isa, ops)


def kernels(which: str | None = None) -> Kernels | None:
    """The kernels of instruction set `which` (default: `isa()`), built and loaded on first
    use; None where they cannot be (no compiler, NANOSERVE_NATIVE=0). Raises ValueError for
    an instruction set this CPU cannot run."""
    if os.environ.get("NANOSERVE_NATIVE", "1") == "0":
        _log_off()
        return None
    chosen = pick_isa(which) if which is not None else isa()
    return _load(chosen)


@functools.cache
def _log_off() -> None:
    log.info("NANOSERVE_NATIVE=0: native kernels off, using stock PyTorch ops")


def available() -> bool:
    """Whether nanoserve's kernels are loaded for this CPU (building them if need be)."""
    return kernels() is not None
