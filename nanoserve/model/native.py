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

`isa()` is NANOSERVE_ISA's set where it names one (`avx2`, `avx512` or `generic`, for tests
and benchmarks; one this machine cannot run is refused with what it lacks, never loaded).
Otherwise (`auto`) the wider set is not taken on trust: on one Intel Xeon the avx512 build
decoded more slowly at batch 1 than the avx2 one. Where the machine runs both, each
multiplies one row by synthetic Q4_0 and Q4_K weights larger than the last-level cache
(batch-1 decode's work, streamed from memory), best of a few passes, once per machine: the
faster set is kept, the wider one unless the narrower wins by more than 3%, and the figures
are logged. The choice is cached as JSON beside the libraries (`isa-choice.json`), keyed by
the CPU's model name, a digest of its flags and XCR0, and the libraries' digests (a kernel
change measures again); a corrupt file is measured over, never trusted, and processes that
start together (a tensor-parallel group's ranks) measure once, under a file lock.

Each library is built with the system's C++ compiler against the installed torch's headers,
cached beside the converted model (`$NANOSERVE_CACHE`, else ~/.cache/nanoserve) under a
digest of the sources, the compiler command and the torch version, so a change to any of
them builds anew and a stale library is never loaded. Each load touches its library; a new
build removes those no process has loaded for 30 days. Symbols are hidden, so that two
builds' inline functions never stand in for each other.

No ninja and no pybind11 (what torch.utils.cpp_extension's JIT needs): one compiler
command, about 20 s on 2 cores, once per instruction set (twice on a machine that measures
its choice, which builds both). Without a compiler, or with NANOSERVE_NATIVE=0, the model
runs its stock-PyTorch path, which gives the same tokens more slowly; the reason is logged
once.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nanoserve.model import cpu
from nanoserve.model.cache import cache_root

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = (_CSRC / "attention.cpp", _CSRC / "layers.cpp", _CSRC / "quant.cpp",
            _CSRC / "panels.cpp", _CSRC / "stack.cpp", _CSRC / "q8dot.cpp")
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

# The flag that gives each build's 8-bit-activation kernels (csrc/q8dot.cpp) their one-
# instruction dot product, vpdpbusd: AVX512-VNNI (with VL) in the avx512 build, AVX-VNNI in
# the avx2 build (its VEX form). Both use the register state the build's own set needs.
_VNNI = {"avx512": "avx512_vnni", "avx2": "avx_vnni"}


def act8_suffix(isa: str, flags: frozenset[str] | None = None) -> str:
    """The format suffix that sends one row of x to `isa`'s 8-bit-activation kernels (see
    csrc/quant.cpp's quant_linear): "+q8v" where the CPU has VNNI for that build, "+q8" (AVX2's
    vpmaddubsw, the same sums) where not, "" for the generic build, which has none."""
    if isa not in _VNNI:
        return ""
    return "+q8v" if _VNNI[isa] in (cpu_flags() if flags is None else flags) else "+q8"


# The measured choice under `auto`: the file beside the libraries, how much faster a
# narrower set must be to be taken over a wider one, and the measurement's size.
CHOICE_FILE = "isa-choice.json"
TIE = 0.03
# The measured formats (model/quant.py's FORMATS, which imports this module): weights and
# bytes per block, and the float16 scales at each block's head (Q4_0's d; Q4_K's d, dmin).
_MEASURE_FORMATS = {"q4_0": (32, 18, 1), "q4_k": (256, 144, 2)}  # 4.5 bits a weight each
_MEASURE_COLS = 4096  # a 1-3B model's hidden size: whole blocks of either format
_MEASURE_MIB = 48  # per format at least; more where the last-level cache is larger
_MEASURE_MAX_MIB = 192  # per format at most, whatever the cache: a bound on time and memory
_MEASURE_REPEATS = 5

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
    """`requested` (NANOSERVE_ISA's value) if the machine runs it, else the widest it runs
    (`isa()` measures among those instead). Raises ValueError naming NANOSERVE_ISA for a
    name it does not know, or a set the CPU lacks or the OS has not enabled (its code would
    die of an illegal instruction)."""
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


def choice_key(facts: cpu.CpuFacts, libraries: Sequence[str]) -> str:
    """What a measured choice holds for: this CPU model, its flags and XCR0 (facts.digest),
    and these builds of the kernels (their file names carry their digests)."""
    kernels = hashlib.sha256(" ".join(sorted(libraries)).encode()).hexdigest()[:16]
    return f"{facts.model}|flags={facts.digest()}|kernels={kernels}"


def choose_isa(candidates: Sequence[str], key: str, path: Path,
               measure: Callable[[Sequence[str]], Mapping[str, float]]) -> str:
    """The faster of `candidates` (widest first) here: as cached in `path` under `key`, else
    timed by `measure` (seconds by instruction set; a set it could not load left out) and
    cached. A narrower set is taken only where it beats the wider by more than TIE."""
    if len(candidates) < 2:
        return candidates[0]
    cached = _read_choice(path, key, candidates)
    if cached is not None:
        return _reuse(*cached, candidates)
    with _locked(path.with_suffix(".lock")):
        cached = _read_choice(path, key, candidates)  # measured while this process waited
        if cached is not None:
            return _reuse(*cached, candidates)
        seconds = measure(candidates)
    timed = [c for c in candidates if c in seconds]
    if len(timed) < 2:  # some build failed: nothing to compare, and nothing worth keeping
        return timed[0] if timed else candidates[0]
    chosen = faster(seconds, timed)
    ms = {c: round(seconds[c] * 1e3, 3) for c in timed}
    _write_choice(path, key, chosen, ms)
    log.info("nanoserve's CPU kernels: a one-row multiply by quantized weights took %s: "
             "auto runs %s on this CPU (kept in %s)", _figures(ms), chosen, path)
    return chosen


def _reuse(chosen: str, ms: Mapping[str, float], candidates: Sequence[str]) -> str:
    log.info("nanoserve's CPU kernels: auto runs %s on this CPU, as measured (%s)", chosen,
             _figures({c: ms[c] for c in candidates if c in ms}))
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


def faster(seconds: Mapping[str, float], candidates: Sequence[str]) -> str:
    """The fastest of `candidates` (widest first) by `seconds`, where a narrower set must
    beat the one it displaces by more than TIE: within noise the wider set is kept."""
    best = candidates[0]
    for c in candidates[1:]:
        if seconds[c] < seconds[best] * (1 - TIE):
            best = c
    return best


def _figures(ms: Mapping[str, float]) -> str:
    return ", ".join(f"{isa} {t:.2f} ms" for isa, t in ms.items())


def _read_choice(path: Path, key: str, candidates: Sequence[str]
                 ) -> tuple[str, dict[str, float]] | None:
    """The choice and figures cached for `key`, or None: none kept, or a file that does not
    hold one this process can run (corrupt, or written by another version)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("nanoserve's CPU kernels: %s unreadable (%s); measuring again", path, e)
        return None
    choices = data.get("choices") if isinstance(data, dict) else None
    entry = choices.get(key) if isinstance(choices, dict) else None
    if entry is None and isinstance(choices, dict):
        return None  # measured on other machines, or for other builds, only
    if not (isinstance(entry, dict) and _valid_entry(entry, candidates)):
        log.warning("nanoserve's CPU kernels: %s does not hold a choice this machine runs; "
                    "measuring again", path)
        return None
    return entry["isa"], entry["ms"]


def _valid_entry(entry: dict[str, Any], candidates: Sequence[str]) -> bool:
    """Whether `entry` is {"isa": one of `candidates`, "ms": {set: milliseconds}}."""
    if entry.get("isa") not in candidates:
        return False
    ms = entry.get("ms")
    return isinstance(ms, dict) and all(
        isinstance(t, int | float) and not isinstance(t, bool) for t in ms.values())


def _write_choice(path: Path, key: str, chosen: str, ms: Mapping[str, float]) -> None:
    """Keep `chosen` under `key` in `path`, beside other machines' choices (a cache shared
    between machines), less this CPU's choices for other builds of the kernels (stale)."""
    try:
        data = json.loads(path.read_text())
        choices = data["choices"] if isinstance(data.get("choices"), dict) else {}
    except (OSError, ValueError, AttributeError, KeyError):
        choices = {}
    cpu_part = key.rpartition("|kernels=")[0]
    choices = {k: v for k, v in choices.items() if k.rpartition("|kernels=")[0] != cpu_part}
    choices[key] = {"isa": chosen, "ms": dict(ms)}
    text = json.dumps({"version": 1, "choices": choices}, indent=1, sort_keys=True)
    try:
        _replace_text(path, text)
    except OSError as e:  # a read-only cache: the next process measures again
        log.warning("nanoserve's CPU kernels: cannot keep the measured choice in %s: %s",
                    path, e)


def _replace_text(path: Path, text: str) -> None:
    """Write `text` to `path` under a temporary name and rename it into place: a reader
    never sees half a file, and two writers cost one of them its entry, never the file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache may be shared
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _measure_decode(candidates: Sequence[str]) -> dict[str, float]:
    """Seconds of one row through synthetic weights larger than the last-level cache, by
    instruction set; a set whose kernels do not load is left out."""
    ops = {c: k.ops for c in candidates if (k := _load(c)) is not None}
    if len(ops) < 2:
        return {c: 0.0 for c in ops}
    row_bytes = _MEASURE_COLS // 32 * 18  # one weight row, in either format
    rows = _measure_bytes() // row_bytes
    return time_decode(ops, decode_weights(rows, _MEASURE_COLS), _MEASURE_COLS)


def _measure_bytes() -> int:
    """Bytes of weights per format: more than the last-level cache holds, so that they
    stream from memory as a model's do at batch-1 decode."""
    mib = 1 << 20
    return min(max(_MEASURE_MIB * mib, _last_level_cache()), _MEASURE_MAX_MIB * mib)


_SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}  # sysfs cache sizes: "32768K"


def _last_level_cache() -> int:
    """Bytes of CPU 0's last-level cache (Linux's sysfs), or 0 where it does not tell."""
    best_level, size = 0, 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        value = (int(text[:-1]) * _SIZE_UNITS[text[-1]] if text[-1:] in _SIZE_UNITS
                 else int(text or 0))
        if level > best_level:
            best_level, size = level, value
    return size


def decode_weights(rows: int, cols: int, seed: int = 0) -> list[tuple[torch.Tensor, str]]:
    """[rows, cols] weights in each measured format (blocks, format): random bytes, as the
    kernels' speed does not depend on them, with every block's float16 scales (d, and Q4_K's
    dmin) set to 0.01 so that no product is subnormal, which would slow it for no reason."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    out = []
    for fmt, (per, size, halves) in _MEASURE_FORMATS.items():
        n = rows * cols // per * size
        # int64 draws, viewed as bytes: eight bytes a draw, several times faster than uint8's
        raw = torch.empty((n + 7) // 8, dtype=torch.int64).random_(generator=g)
        blocks = raw.view(torch.uint8)[:n].view(rows * cols // per, size)
        blocks[:, : 2 * halves] = scale.repeat(halves)
        out.append((blocks.view(rows, -1), fmt))
    return out


def time_decode(ops: Mapping[str, Any], weights: Sequence[tuple[torch.Tensor, str]],
                cols: int, *, repeats: int = _MEASURE_REPEATS,
                timer: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Best-of-`repeats` seconds, by instruction set, of `ops.quant_linear` over one row x
    [1, cols] and every weight [rows, cols] once. The sets take turns within each repeat, so
    that a neighbour's load on a shared machine falls on all of them alike."""
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(1))
    outs = [torch.empty(1, blocks.shape[0]) for blocks, _ in weights]

    def once(o: Any) -> None:
        for (blocks, fmt), out in zip(weights, outs, strict=True):
            o.quant_linear(x, blocks, fmt, out)

    for o in ops.values():
        once(o)  # first touch: page faults and thread start-up are no kernel's time
    best = dict.fromkeys(ops, float("inf"))
    for _ in range(repeats):
        for isa_name, o in ops.items():
            start = timer()
            once(o)
            best[isa_name] = min(best[isa_name], timer() - start)
    return best


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
