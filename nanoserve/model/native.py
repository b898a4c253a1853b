"""nanoserve's own CPU kernels (model/csrc/*.cpp), compiled on this machine on first use,
once per instruction set, and the run-time choice of which one runs.

The sources build into one shared library per instruction set, each registering its ops
under its own name so that several can be loaded in one process (the tests run each):

    avx512   AVX-512 F/BW/DQ/VL, FMA, F16C     torch.ops.nanoserve_avx512
    avx2     AVX2, FMA, F16C                   torch.ops.nanoserve_avx2
    generic  the compiler's baseline           torch.ops.nanoserve_generic

Which sets this machine runs (`supported()`) is decided by what the CPU advertises
(/proc/cpuinfo's flags) and what the OS has enabled (XCR0's register state, model/cpu.py):
a hypervisor or kernel can list AVX-512 and leave its registers off, and the AVX-512 build
would then die of an illegal instruction. The flags each build is compiled with are
exactly the flags it is chosen by, never -march=native, so a cached library runs on every
CPU that has them: one cache, shared between an AVX-512 and an AVX2 machine, serves both
at full speed. Importing this module also holds oneDNN (PyTorch's int8 GEMM) to what the OS
enabled where the CPU lists more (cpu.limit_onednn), before any model runs it.

`isa()` picks the best set this machine runs, or the one NANOSERVE_ISA names (`avx2`,
`avx512` or `generic`, for tests and benchmarks; one this machine cannot run is refused with
what it lacks, never loaded).

Each library is built with the system's C++ compiler against the installed torch's headers,
cached beside the converted model (`$NANOSERVE_CACHE`, else ~/.cache/nanoserve) under a
digest of the sources, the compiler command and the torch version, so a change to any of
them builds anew and a stale library is never loaded. Each load touches its library; a new
build removes those no process has loaded for 30 days. Symbols are hidden, so that two
builds' inline functions never stand in for each other.

No ninja and no pybind11 (what torch.utils.cpp_extension's JIT needs): one compiler
command, about 20 s on 2 cores, once per instruction set. Without a compiler, or with
NANOSERVE_NATIVE=0, the model runs its stock-PyTorch path, which gives the same tokens more
slowly; the reason is logged once.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nanoserve.model import cpu
from nanoserve.model.cache import cache_root

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = (_CSRC / "attention.cpp", _CSRC / "layers.cpp", _CSRC / "quant.cpp",
            _CSRC / "panels.cpp", _CSRC / "stack.cpp")
_HEADERS = (_CSRC / "vec.h", _CSRC / "kernels.h")
STALE_AFTER_S = 30 * 86400

# Best first. The compiler flags of each build, and the /proc/cpuinfo flags a CPU needs to
# run it: the same instructions.
ISAS = ("avx512", "avx2", "generic")
_COMPILE = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx2", "-mfma",
               "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "generic": [],
}
_NEEDS = {
    "avx512": frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx2", "fma",
                         "f16c"}),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "generic": frozenset(),
}

# oneDNN reads its ISA cap once, at its first primitive; every path to a model imports this
# module before that (llama.py, weights.py, quant.py), so the cap is set here.
cpu.limit_onednn(cpu.host())


@dataclass(frozen=True, slots=True)
class Kernels:
    """One instruction set's loaded kernels: `ops.quant_linear(...)` and the rest."""

    isa: str
    ops: Any  # torch.ops.nanoserve_<isa>


def cpu_flags() -> frozenset[str]:
    """The CPU's instruction-set flags (Linux's /proc/cpuinfo), or none where it does not
    tell: what it advertises, whether or not the OS enabled it (see supported())."""
    return cpu.cpu_flags()


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def _facts(flags: frozenset[str] | None, xcr0: int | None, amx_permitted: bool | None
           ) -> cpu.CpuFacts:
    """This host's facts where `flags` is None; else the ones given (a CPU described by a
    test: its XCR0 unknown, so its flags trusted, unless `xcr0` says otherwise)."""
    return cpu.host() if flags is None else cpu.CpuFacts(flags, xcr0, amx_permitted)


def supported(flags: frozenset[str] | None = None, *, x86: bool | None = None,
              xcr0: int | None = None, amx_permitted: bool | None = None
              ) -> tuple[str, ...]:
    """The instruction sets a CPU with `flags` runs under an OS that enabled the register
    state `xcr0`, best first (generic always). Default: this machine's."""
    if not (_x86() if x86 is None else x86):
        return ("generic",)
    have = _facts(flags, xcr0, amx_permitted).usable
    return tuple(isa for isa in ISAS if _NEEDS[isa] <= have)


def pick_isa(requested: str | None, flags: frozenset[str] | None = None, *,
             x86: bool | None = None, xcr0: int | None = None,
             amx_permitted: bool | None = None) -> str:
    """`requested` (NANOSERVE_ISA's value) if the machine runs it, else the widest it runs.
    Raises ValueError naming NANOSERVE_ISA for a name it does not know, or a set the CPU
    lacks or the OS has not enabled (its code would die of an illegal instruction)."""
    can = supported(flags, x86=x86, xcr0=xcr0, amx_permitted=amx_permitted)
    if not requested:
        return can[0]
    if requested not in ISAS:
        raise ValueError(f"NANOSERVE_ISA must be one of {', '.join(ISAS)}, got {requested!r}")
    if requested not in can:
        why = _why_not(requested, _facts(flags, xcr0, amx_permitted))
        raise ValueError(f"NANOSERVE_ISA={requested}: {why}; it runs {', '.join(can)}")
    return requested


def _why_not(isa: str, facts: cpu.CpuFacts) -> str:
    """Why a machine with `facts` cannot run `isa`: flags its CPU lacks, or register state
    its OS has not enabled."""
    lacks = sorted(_NEEDS[isa] - facts.flags)
    if lacks:
        return f"this CPU lacks {', '.join(lacks)}"
    off = sorted(_NEEDS[isa] - facts.usable)
    if off and facts.xcr0 is not None:
        state = ", ".join(cpu.missing_state(off, facts.xcr0))
        return (f"this CPU has {', '.join(off)} but the OS has not enabled their registers "
                f"(XCR0 {facts.xcr0:#x} lacks {state})")
    return "this CPU lacks x86-64"


def isa() -> str:
    """The instruction set the kernels run with here (NANOSERVE_ISA, else the best this
    machine runs)."""
    return pick_isa(os.environ.get("NANOSERVE_ISA"))


def _command(sources: tuple[Path, ...], output: Path, compiler: str, isa: str) -> list[str]:
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [compiler, "-O3", *(_COMPILE[isa] if _x86() else []), "-std=c++20", "-fPIC",
           "-shared", "-fopenmp", "-fvisibility=hidden", "-fvisibility-inlines-hidden",
           f"-DNANOSERVE_NS=nanoserve_{isa}", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-w"]
    cmd += [f"-I{p}" for p in cpp_extension.include_paths()]
    cmd += [str(s) for s in sources]
    for lib in cpp_extension.library_paths():
        cmd += [f"-L{lib}", f"-Wl,-rpath,{lib}"]
    return [*cmd, "-lc10", "-ltorch_cpu", "-o", str(output)]


def _compiler() -> str:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or c++) on PATH")
    return compiler


def _library(root: Path, isa: str, compiler: str) -> Path:
    """Where `isa`'s library is cached: named by a digest of the torch version, the sources
    and the compiler command, so that a change to any of them is another library."""
    digest = hashlib.sha256(torch.__version__.encode())
    for s in (*_SOURCES, *_HEADERS):
        digest.update(s.read_bytes())
    digest.update(" ".join(_command(_SOURCES, Path("out"), compiler, isa)).encode())
    return root / "native" / f"nanoserve_ops-{isa}-{digest.hexdigest()[:16]}.so"


def _build(root: Path, isa: str) -> Path:
    compiler = _compiler()
    lib = _library(root, isa, compiler)
    folder = lib.parent
    if lib.exists():
        with contextlib.suppress(OSError):  # a read-only cache still loads
            os.utime(lib)  # in use: kept by _prune
        return lib
    folder.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed into place: a concurrent build by another
    # process then costs time, never a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        log.info("building nanoserve's CPU kernels for %s into %s (once, about 20 s)", isa,
                 lib)
        done = subprocess.run(_command(_SOURCES, Path(tmp), compiler, isa), capture_output=True,
                              text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"compiler failed: {done.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o755)  # mkstemp makes it private; the cache may be shared
        os.replace(tmp, lib)
    finally:
        Path(tmp).unlink(missing_ok=True)
    _prune(folder, keep=lib, now=time.time())
    return lib


def _prune(folder: Path, keep: Path, now: float, max_age_s: float = STALE_AFTER_S) -> None:
    """Remove libraries no process has loaded for `max_age_s` before `now` (each load
    touches its library): every edit of the sources or torch upgrade leaves one behind, and
    one still loaded by another torch or another CPU sharing the cache stays fresh."""
    cutoff = now - max_age_s
    for old in folder.glob("nanoserve_ops-*.so"):
        with contextlib.suppress(OSError):  # gone already, or not ours to remove
            if old != keep and old.stat().st_mtime < cutoff:
                old.unlink()


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
