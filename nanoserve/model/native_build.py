"""The build of nanoserve's CPU kernels (csrc/*.cpp) into one shared library per
instruction set (model/isa_support.py), each registering its ops under its own name
(torch.ops.nanoserve_<isa>) so that several can be loaded in one process.

Each library is built with the system's C++ compiler against the installed torch's headers,
cached beside the converted model (`$NANOSERVE_CACHE`, else ~/.cache/nanoserve) under a
digest of the sources, the compiler command and the torch version, so a change to any of
them builds anew and a stale library is never loaded. Each load touches its library; a new
build removes those no process has loaded for 30 days. Symbols are hidden, so that two
builds' inline functions never stand in for each other.

No ninja and no pybind11 (what torch.utils.cpp_extension's JIT needs): each source compiled
to an object by its own compiler process, as many at once as the process may use CPUs, then
one link; once per instruction set (twice on a machine that measures its choice, which builds
both). On a 2-vCPU Zen 3 the AVX2 library took 71 s as one compiler command over the six
sources and 38-45 s as two at a time (2026-12-07).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from nanoserve.model.cpu import cpu_count
from nanoserve.model.isa_support import COMPILE, is_x86

# native.py's logger: every line about the kernels, built, chosen or loaded, under one name
log = logging.getLogger("nanoserve.model.native")

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = (_CSRC / "attention.cpp", _CSRC / "layers.cpp", _CSRC / "quant.cpp",
            _CSRC / "panels.cpp", _CSRC / "stack.cpp", _CSRC / "q8dot.cpp")
_HEADERS = (_CSRC / "vec.h", _CSRC / "kernels.h", _CSRC / "rows.h")
STALE_AFTER_S = 30 * 86400


def _compile_flags(compiler: str, isa: str) -> list[str]:
    """The compiler and its flags for every source (`-c SOURCE -o OBJECT` follow)."""
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [compiler, "-O3", *(COMPILE[isa] if is_x86() else []), "-std=c++20", "-fPIC",
           "-fopenmp", "-fvisibility=hidden", "-fvisibility-inlines-hidden",
           f"-DNANOSERVE_NS=nanoserve_{isa}", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-w"]
    return cmd + [f"-I{p}" for p in cpp_extension.include_paths()]


def _link_flags() -> list[str]:
    """What the link adds after the objects: torch's libraries, found at run time by rpath."""
    from torch.utils import cpp_extension

    flags = []
    for lib in cpp_extension.library_paths():
        flags += [f"-L{lib}", f"-Wl,-rpath,{lib}"]
    return [*flags, "-lc10", "-ltorch_cpu"]


def _compile(compiler: str, isa: str, output: Path) -> None:
    """Every source to an object, in parallel, then the one shared library at `output`;
    RuntimeError with the compiler's last words where a step fails."""
    flags = _compile_flags(compiler, isa)
    with tempfile.TemporaryDirectory(dir=output.parent) as objects:
        jobs = [(s, Path(objects) / f"{s.stem}.o") for s in _SOURCES]

        def run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
            return subprocess.run(cmd, capture_output=True, text=True, check=False)

        with ThreadPoolExecutor(max_workers=min(len(jobs), cpu_count())) as pool:
            steps = list(pool.map(run, ([*flags, "-c", str(s), "-o", str(o)] for s, o in jobs)))
        if all(step.returncode == 0 for step in steps):
            steps.append(run([compiler, "-shared", "-fopenmp", *(str(o) for _, o in jobs),
                              *_link_flags(), "-o", str(output)]))
        for step, name in zip(steps, [*(s.name for s, _ in jobs), "the link"], strict=False):
            if step.returncode != 0:
                raise RuntimeError(f"compiler failed on {name} (exit {step.returncode}): "
                                   f"{step.stderr.strip()[-2000:]}")


def find_compiler() -> str:
    """$CXX, else g++ or c++ on PATH; RuntimeError where there is none."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or c++) on PATH")
    return compiler


def library(root: Path, isa: str, compiler: str) -> Path:
    """Where `isa`'s library is cached: named by a digest of the torch version, the sources
    and the compiler command, so that a change to any of them is another library."""
    digest = hashlib.sha256(torch.__version__.encode())
    for s in (*_SOURCES, *_HEADERS):
        digest.update(s.read_bytes())
    digest.update(" ".join([*_compile_flags(compiler, isa), *_link_flags()]).encode())
    return root / "native" / f"nanoserve_ops-{isa}-{digest.hexdigest()[:16]}.so"


def build(root: Path, isa: str) -> Path:
    """`isa`'s library under `root`: the cached one (touched: in use), else built now."""
    compiler = find_compiler()
    lib = library(root, isa, compiler)
    folder = lib.parent
    if lib.exists():
        with contextlib.suppress(OSError):  # a read-only cache still loads
            os.utime(lib)  # in use: kept by prune
        return lib
    folder.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed into place: a concurrent build by another
    # process then costs time, never a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        log.info("building nanoserve's CPU kernels for %s into %s (once, under a minute)",
                 isa, lib)
        _compile(compiler, isa, Path(tmp))
        os.chmod(tmp, 0o755)  # mkstemp makes it private; the cache may be shared
        os.replace(tmp, lib)
    finally:
        Path(tmp).unlink(missing_ok=True)
    prune(folder, keep=lib, now=time.time())
    return lib


def prune(folder: Path, keep: Path, now: float, max_age_s: float = STALE_AFTER_S) -> None:
    """Remove libraries no process has loaded for `max_age_s` before `now` (each load
    touches its library): every edit of the sources or torch upgrade leaves one behind, and
    one still loaded by another torch or another CPU sharing the cache stays fresh."""
    cutoff = now - max_age_s
    for old in folder.glob("nanoserve_ops-*.so"):
        with contextlib.suppress(OSError):  # gone already, or not ours to remove
            if old != keep and old.stat().st_mtime < cutoff:
                old.unlink()
