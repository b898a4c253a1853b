"""What this CPU can run: what it advertises, and what the operating system has enabled.

/proc/cpuinfo's flags say which instructions the CPU implements. An instruction that uses
registers the OS does not save and restore across context switches still dies of an
illegal instruction: the OS says which register state it manages in XCR0, read with
`xgetbv`. A hypervisor or a kernel can pass the CPU's AVX-512 (or AMX) flags through while
leaving that state off, and then only XCR0 tells. The state each family needs:

    AVX, AVX2, FMA, F16C    SSE | AVX (XCR0 bits 1, 2)
    AVX-512                 also opmask, ZMM_Hi256, Hi16_ZMM (bits 5, 6, 7)
    AMX                     XTILECFG, XTILEDATA (bits 17, 18), and on Linux the process's
                            permission, asked for with arch_prctl(ARCH_REQ_XCOMP_PERM)

XCR0 is read without a compiler: thirteen bytes of machine code in an executable page
mapped through ctypes. Where that cannot run (not x86-64 Linux, no `xsave` flag, or a
system that refuses executable memory) the value is unknown and the flags are trusted,
as before. `CpuFacts` holds the three facts, so a test can state any combination.

nanoserve's own kernels never use AMX, but oneDNN (PyTorch's int8 GEMM under
`--int8-activations`, model/int8.py) may: where the CPU lists a set the OS has not enabled,
`limit_onednn` holds oneDNN to the best set the OS runs through ONEDNN_MAX_CPU_ISA, which
oneDNN reads once, at its first primitive (cpu_isa_traits.cpp's set-once setting).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import mmap
import os
import platform
import sys
from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

# XCR0's state components (Intel SDM vol. 1, 13.1), by bit.
X87, SSE, AVX = 1 << 0, 1 << 1, 1 << 2
OPMASK, ZMM_HI256, HI16_ZMM = 1 << 5, 1 << 6, 1 << 7
XTILECFG, XTILEDATA = 1 << 17, 1 << 18
_STATE_NAMES = {X87: "x87", SSE: "SSE", AVX: "AVX", OPMASK: "opmask", ZMM_HI256: "ZMM_Hi256",
                HI16_ZMM: "Hi16_ZMM", XTILECFG: "XTILECFG", XTILEDATA: "XTILEDATA"}
AVX_STATE = SSE | AVX
AVX512_STATE = AVX_STATE | OPMASK | ZMM_HI256 | HI16_ZMM
AMX_STATE = XTILECFG | XTILEDATA
# The VEX-encoded sets whose names do not start with "avx" (those that do need AVX_STATE,
# "avx512..." AVX512_STATE).
_VEX_FLAGS = frozenset({"fma", "f16c", "fma4", "xop", "vaes", "vpclmulqdq"})

# xor ecx, ecx; xgetbv; shl rdx, 32; or rax, rdx; ret: XCR(ecx = 0), edx:eax as one value.
_XGETBV_CODE = bytes([0x31, 0xC9, 0x0F, 0x01, 0xD0, 0x48, 0xC1, 0xE2, 0x20, 0x48, 0x09, 0xD0,
                      0xC3])
# Linux x86-64's arch_prctl: the syscall number, its AMX requests, the tile data's xfeature.
_SYS_ARCH_PRCTL = 158
_ARCH_GET_XCOMP_PERM, _ARCH_REQ_XCOMP_PERM = 0x1022, 0x1023
_XFEATURE_XTILEDATA = 18

ONEDNN_ENV = "ONEDNN_MAX_CPU_ISA"
_ONEDNN_ENVS = (ONEDNN_ENV, "DNNL_MAX_CPU_ISA")  # oneDNN reads either (the old name second)
_AVX512_CORE = frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl"})


@dataclass(frozen=True, slots=True)
class CpuFacts:
    """What decides which instructions run here.

    `xcr0` None: not read (see the module's docstring), so the flags are trusted.
    `amx_permitted` None: not asked (no amx_tile flag, or XCR0 already rules AMX out)."""

    flags: frozenset[str]
    xcr0: int | None = None
    amx_permitted: bool | None = None
    model: str = ""

    @property
    def usable(self) -> frozenset[str]:
        """The flags whose instructions the OS lets run."""
        return usable_flags(self.flags, self.xcr0, self.amx_permitted)

    def digest(self) -> str:
        """A short digest of the flags and XCR0: what a measurement on this CPU is keyed by
        besides its model name (a BIOS, kernel or hypervisor change re-measures)."""
        xcr0 = "unknown" if self.xcr0 is None else hex(self.xcr0)
        text = " ".join(sorted(self.flags)) + f" xcr0={xcr0} amx={self.amx_permitted}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def state_needed(flag: str) -> int:
    """The XCR0 bits an instruction-set flag's instructions need (0: none beyond x87)."""
    if flag.startswith("avx512"):
        return AVX512_STATE
    if flag.startswith("amx"):
        return AMX_STATE
    if flag.startswith("avx") or flag in _VEX_FLAGS:
        return AVX_STATE
    return 0


def usable_flags(flags: frozenset[str], xcr0: int | None, amx_permitted: bool | None
                 ) -> frozenset[str]:
    """`flags` less those whose register state XCR0 leaves off, and AMX's where the process
    was refused permission. XCR0 unknown (None): `flags` as they are."""
    if xcr0 is None:
        return flags

    def runs(flag: str) -> bool:
        need = state_needed(flag)
        if need & ~xcr0:
            return False
        return not (need == AMX_STATE and amx_permitted is False)

    return frozenset(f for f in flags if runs(f))


def missing_state(flags: Iterable[str], xcr0: int) -> list[str]:
    """The names of the state components `flags` need that XCR0 leaves off, by bit."""
    need = 0
    for f in flags:
        need |= state_needed(f)
    return [name for bit, name in sorted(_STATE_NAMES.items()) if need & bit & ~xcr0]


def cpu_count() -> int:
    """The CPUs this process may run on (taskset, cgroups' cpusets), not the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def cpu_flags() -> frozenset[str]:
    """The CPU's instruction-set flags (Linux's /proc/cpuinfo), or none where it does not
    tell."""
    return frozenset(_cpuinfo_field("flags").split())


def model_name() -> str:
    """The CPU's model name (/proc/cpuinfo), or "" where it does not tell."""
    return _cpuinfo_field("model name")


def _cpuinfo_field(name: str) -> str:
    """The first processor's `name` line of /proc/cpuinfo, stripped ("" without one)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return ""


def _x86_64_linux() -> bool:
    return sys.platform == "linux" and platform.machine().lower() in ("x86_64", "amd64")


def read_xcr0(flags: frozenset[str]) -> int | None:
    """XCR0, or None where it cannot be read safely: `xgetbv` itself is an illegal
    instruction unless the OS enabled XSAVE, which Linux shows as the `xsave` flag."""
    if not (_x86_64_linux() and "xsave" in flags):
        return None
    try:
        return _run_code(_XGETBV_CODE)
    except OSError as e:  # executable memory refused (SELinux execmem, PaX): trust the flags
        log.debug("cannot read XCR0 (%s); trusting /proc/cpuinfo's flags", e)
        return None


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.syscall.restype = ctypes.c_long
    return libc


def _run_code(code: bytes) -> int:
    """Call `code` (x86-64, no arguments, result in rax) and return its result. The page is
    written while writable and only then made executable, never both at once (W^X)."""
    libc = _libc()
    size = mmap.PAGESIZE
    page = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE,
                     mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if page is None or page == ctypes.c_void_p(-1).value:
        raise OSError(ctypes.get_errno(), "mmap of a page failed")
    try:
        ctypes.memmove(page, code, len(code))
        if libc.mprotect(page, size, mmap.PROT_READ | mmap.PROT_EXEC) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mprotect to executable: {os.strerror(err)}")
        return int(ctypes.CFUNCTYPE(ctypes.c_uint64)(page)())
    finally:
        libc.munmap(page, size)


def request_amx() -> bool:
    """Whether this process may use AMX's tile data: Linux grants it per process on request
    (arch_prctl ARCH_REQ_XCOMP_PERM), as oneDNN and ATen ask before their AMX kernels; a
    kernel without AMX support, or one that refuses, answers with an error."""
    libc = _libc()
    granted = ctypes.c_ulong(0)

    def permitted() -> bool:
        got = libc.syscall(ctypes.c_long(_SYS_ARCH_PRCTL), ctypes.c_long(_ARCH_GET_XCOMP_PERM),
                           ctypes.byref(granted))
        return got == 0 and bool(granted.value & (1 << _XFEATURE_XTILEDATA))

    if permitted():
        return True
    asked = libc.syscall(ctypes.c_long(_SYS_ARCH_PRCTL), ctypes.c_long(_ARCH_REQ_XCOMP_PERM),
                         ctypes.c_ulong(_XFEATURE_XTILEDATA))
    return asked == 0 and permitted()


@functools.cache
def host() -> CpuFacts:
    """This machine's facts, read once per process."""
    flags = cpu_flags()
    xcr0 = read_xcr0(flags)
    amx: bool | None = None
    if "amx_tile" in flags and xcr0 is not None and xcr0 & AMX_STATE == AMX_STATE:
        amx = request_amx()
    return CpuFacts(flags, xcr0, amx, model_name())


def onednn_cap(facts: CpuFacts) -> str | None:
    """The ONEDNN_MAX_CPU_ISA that keeps oneDNN to what the OS enabled, or None where the OS
    runs everything the CPU lists. A cap, not a choice: oneDNN still takes the lesser of it
    and what it detects, so AVX512_CORE_BF16 on a CPU without BF16 runs AVX512_CORE. The
    names are those every oneDNN 2.x and 3.x accepts."""
    usable = facts.usable
    if usable == facts.flags:
        return None
    if usable >= _AVX512_CORE:
        return "AVX512_CORE_BF16"
    if "avx2" in usable:
        return "AVX2"
    if "avx" in usable:
        return "AVX"
    return "SSE41"


def limit_onednn(facts: CpuFacts, env: MutableMapping[str, str] | None = None) -> str | None:
    """Set ONEDNN_MAX_CPU_ISA in `env` (default: os.environ) to `onednn_cap(facts)`, unless
    the user set it (or the older DNNL_MAX_CPU_ISA); the value set, or None."""
    env = os.environ if env is None else env
    cap = onednn_cap(facts)
    if cap is None or any(name in env for name in _ONEDNN_ENVS):
        return None
    env[ONEDNN_ENV] = cap
    off = sorted(facts.flags - facts.usable)
    log.info("the CPU lists %s but the OS has not enabled them: oneDNN held to %s=%s",
             ", ".join(off), ONEDNN_ENV, cap)
    return cap
