"""The instruction sets nanoserve's CPU kernels are built for (model/native.py), and which
of them a CPU runs: what it advertises (/proc/cpuinfo's flags) and what the OS has enabled
(XCR0's register state, model/cpu.py). A hypervisor or kernel can list AVX-512 and leave
its registers off, and the AVX-512 build would then die of an illegal instruction. The
flags each build is compiled with are exactly the flags it is chosen by, never
-march=native, so a cached library runs on every CPU that has them.
"""

from __future__ import annotations

import platform

from nanoserve.model import cpu

# Best first. The compiler flags of each build, and the /proc/cpuinfo flags a CPU needs to
# run it: the same instructions.
ISAS = ("avx512", "avx2", "generic")
COMPILE = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx2", "-mfma",
               "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "generic": [],
}
NEEDS = {
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


def cpu_flags() -> frozenset[str]:
    """The CPU's instruction-set flags (Linux's /proc/cpuinfo), or none where it does not
    tell: what it advertises, whether or not the OS enabled it (see supported())."""
    return cpu.cpu_flags()


def is_x86() -> bool:
    """Whether this machine is x86-64: elsewhere every build is the compiler's baseline."""
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
    if not (is_x86() if x86 is None else x86):
        return ("generic",)
    have = _facts(flags, xcr0, amx_permitted).usable
    return tuple(isa for isa in ISAS if NEEDS[isa] <= have)


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
    lacks = sorted(NEEDS[isa] - facts.flags)
    if lacks:
        return f"this CPU lacks {', '.join(lacks)}"
    off = sorted(NEEDS[isa] - facts.usable)
    if off and facts.xcr0 is not None:
        state = ", ".join(cpu.missing_state(off, facts.xcr0))
        return (f"this CPU has {', '.join(off)} but the OS has not enabled their registers "
                f"(XCR0 {facts.xcr0:#x} lacks {state})")
    return "this CPU lacks x86-64"
