"""nanoserve's own CPU kernels (model/csrc/*.cpp), compiled on this machine on first use.

The source is built with the system's C++ compiler against the installed torch's headers
into a shared library that registers `torch.ops.nanoserve.*`, cached beside the converted
model (`$NANOSERVE_CACHE`, else ~/.cache/nanoserve) under a digest of the source, the
compiler command, the torch version and the CPU's instruction-set flags, so a change to any
of them builds anew and a stale library is never loaded: `-march=native` code is only ever
loaded on the kind of CPU that built it, even from a cache shared between machines. Each
load touches its library; a new build removes those no process has loaded for 30 days.

No ninja and no pybind11 (what torch.utils.cpp_extension's JIT needs): one compiler
command, about 20 s on 2 cores, once. Without a compiler, or with NANOSERVE_NATIVE=0, the
model runs its stock-PyTorch path, which gives the same tokens more slowly; the reason is
logged once.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from nanoserve.model.loader import cache_root

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = (_CSRC / "attention.cpp", _CSRC / "layers.cpp", _CSRC / "quant.cpp",
            _CSRC / "stack.cpp")
_HEADERS = (_CSRC / "vec.h", _CSRC / "kernels.h")
STALE_AFTER_S = 30 * 86400


def _command(sources: tuple[Path, ...], output: Path, compiler: str) -> list[str]:
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [compiler, "-O3", "-march=native", "-std=c++20", "-fPIC", "-shared", "-fopenmp",
           f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-w"]
    cmd += [f"-I{p}" for p in cpp_extension.include_paths()]
    cmd += [str(s) for s in sources]
    for lib in cpp_extension.library_paths():
        cmd += [f"-L{lib}", f"-Wl,-rpath,{lib}"]
    return [*cmd, "-lc10", "-ltorch_cpu", "-o", str(output)]


def _cpu_flags() -> bytes:
    """The CPU's instruction-set flags (Linux), or nothing where /proc does not tell."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return b""


def _build(root: Path) -> Path:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or c++) on PATH")
    digest = hashlib.sha256(torch.__version__.encode() + _cpu_flags())
    for s in (*_SOURCES, *_HEADERS):
        digest.update(s.read_bytes())
    digest.update(" ".join(_command(_SOURCES, Path("out"), compiler)).encode())
    folder = root / "native"
    lib = folder / f"nanoserve_ops-{digest.hexdigest()[:16]}.so"
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
        log.info("building nanoserve's CPU kernels into %s (once, about 20 s)", lib)
        done = subprocess.run(_command(_SOURCES, Path(tmp), compiler), capture_output=True,
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
def available() -> bool:
    """Whether torch.ops.nanoserve's kernels are loaded (building them if need be)."""
    if os.environ.get("NANOSERVE_NATIVE", "1") == "0":
        log.info("NANOSERVE_NATIVE=0: native kernels off, using stock PyTorch ops")
        return False
    try:
        torch.ops.load_library(str(_build(cache_root())))
    except (OSError, RuntimeError) as e:
        log.warning("native kernels unavailable, using stock PyTorch ops: %s", e)
        return False
    return True
