"""Which instruction sets run here (model/cpu.py, model/native.py): what the CPU advertises
less what the OS has not enabled (XCR0), and oneDNN held to the same. Every fact is
injected, so each case runs on any host; one test reads this host's own XCR0."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys

import pytest

from nanoserve.model import cpu, native

# /proc/cpuinfo's flags of an AVX-512 host with AMX (a Sapphire Rapids Xeon), trimmed.
SPR_FLAGS = frozenset(["fpu", "sse", "sse2", "ssse3", "sse4_1", "sse4_2", "xsave", "avx", "f16c",
                       "fma", "avx2", "avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl",
                       "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"])
SSE_AVX = cpu.X87 | cpu.SSE | cpu.AVX  # 0b111: the OS enabled AVX and nothing wider
ALL_STATE = cpu.X87 | cpu.AVX512_STATE | cpu.AMX_STATE  # 0x600e7


# ---- what the OS has enabled ------------------------------------------------------------

def test_each_flag_needs_its_register_state() -> None:
    assert [cpu.state_needed(f) for f in ("sse4_2", "avx", "avx2", "fma", "f16c", "vaes",
                                          "avx512f", "avx512_bf16", "amx_tile", "amx_int8")] \
        == [0, 0b110, 0b110, 0b110, 0b110, 0b110, 0xE6, 0xE6, 0x60000, 0x60000]


def test_avx512_advertised_but_off_runs_avx2_and_a_forced_avx512_is_refused() -> None:
    assert native.supported(SPR_FLAGS, x86=True, xcr0=SSE_AVX) == ("avx2", "generic")
    assert native.pick_isa(None, SPR_FLAGS, x86=True, xcr0=SSE_AVX) == "avx2"
    message = ("NANOSERVE_ISA=avx512: this CPU has avx512bw, avx512dq, avx512f, avx512vl but "
               "the OS has not enabled their registers (XCR0 0x7 lacks opmask, ZMM_Hi256, "
               "Hi16_ZMM); it runs avx2, generic")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        native.pick_isa("avx512", SPR_FLAGS, x86=True, xcr0=SSE_AVX)


def test_an_os_with_only_x87_and_sse_runs_generic() -> None:
    assert native.supported(SPR_FLAGS, x86=True, xcr0=cpu.X87 | cpu.SSE) == ("generic",)
    message = ("NANOSERVE_ISA=avx2: this CPU has avx2, f16c, fma but the OS has not enabled "
               "their registers (XCR0 0x3 lacks AVX); it runs generic")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        native.pick_isa("avx2", SPR_FLAGS, x86=True, xcr0=cpu.X87 | cpu.SSE)


def test_an_unknown_xcr0_trusts_the_flags_and_a_full_one_runs_everything() -> None:
    assert native.supported(SPR_FLAGS, x86=True) == ("avx512", "avx2", "generic")
    assert native.supported(SPR_FLAGS, x86=True, xcr0=ALL_STATE,
                            amx_permitted=True) == ("avx512", "avx2", "generic")
    facts = cpu.CpuFacts(SPR_FLAGS, ALL_STATE, True)
    assert facts.usable == SPR_FLAGS
    # AMX refused by the kernel: only its flags go (nanoserve's kernels never used them).
    refused = cpu.CpuFacts(SPR_FLAGS, ALL_STATE, False)
    assert SPR_FLAGS - refused.usable == {"amx_bf16", "amx_tile", "amx_int8"}


@pytest.mark.skipif(not (sys.platform == "linux" and platform.machine() == "x86_64")
                    or "xsave" not in cpu.cpu_flags(), reason="reads XCR0 on x86-64 Linux")
def test_this_hosts_xcr0_enables_what_its_flags_list() -> None:
    flags = cpu.cpu_flags()
    xcr0 = cpu.read_xcr0(flags)
    assert xcr0 is not None
    assert xcr0 & (cpu.SSE | cpu.AVX) == cpu.SSE | cpu.AVX
    if "avx512f" in flags:
        assert xcr0 & 0xE0 == 0xE0  # opmask, ZMM_Hi256, Hi16_ZMM
    assert cpu.host().xcr0 == xcr0


# ---- oneDNN kept to what the OS enabled -------------------------------------------------

@pytest.mark.parametrize(("xcr0", "amx", "cap"), [
    (cpu.X87 | cpu.AVX512_STATE, None, "AVX512_CORE_BF16"),  # AMX state off
    (ALL_STATE, False, "AVX512_CORE_BF16"),  # AMX state on, the process refused
    (SSE_AVX, None, "AVX2"),
    (cpu.X87 | cpu.SSE, None, "SSE41"),
    (ALL_STATE, True, None),  # everything runs: oneDNN left alone
])
def test_onednn_is_capped_where_the_cpu_lists_a_set_the_os_has_not_enabled(
        xcr0: int, amx: bool | None, cap: str | None) -> None:
    facts = cpu.CpuFacts(SPR_FLAGS, xcr0, amx)
    assert cpu.onednn_cap(facts) == cap
    env: dict[str, str] = {}
    assert cpu.limit_onednn(facts, env) == cap
    assert env == ({} if cap is None else {"ONEDNN_MAX_CPU_ISA": cap})


@pytest.mark.parametrize("name", ["ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"])
def test_a_users_onednn_cap_is_kept(name: str) -> None:
    env = {name: "AVX512_CORE_AMX"}
    assert cpu.limit_onednn(cpu.CpuFacts(SPR_FLAGS, SSE_AVX), env) is None
    assert env == {name: "AVX512_CORE_AMX"}


@pytest.mark.skipif("avx2" not in cpu.host().usable, reason="shows oneDNN's AVX2 code")
def test_importing_the_kernels_caps_onednn_before_int8_activations_run() -> None:
    """End to end in a fresh process: a CPU that lists AVX-512 and AMX under an OS that
    enabled only AVX; importing model/native.py sets the cap, and `--int8-activations`'
    GEMM (oneDNN, which reads the cap at its first primitive) then runs AVX2 code."""
    code = (
        "import os, torch\n"
        "from nanoserve.model import cpu\n"
        f"cpu.host = lambda: cpu.CpuFacts(frozenset({sorted(SPR_FLAGS)!r}), {SSE_AVX})\n"
        "from nanoserve.model import native\n"
        "from nanoserve.model.int8 import Int8Weight\n"
        "w, x = torch.randn(96, 64), torch.randn(128, 64)\n"
        "Int8Weight(w, x.abs().amax(dim=0))(x)\n"
        "print('cap', os.environ['ONEDNN_MAX_CPU_ISA'])\n")
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA",
                                                            "DNNL_MAX_CPU_ISA")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**env, "ONEDNN_VERBOSE": "1"}, check=True, timeout=300)
    lines = done.stdout.splitlines()
    assert "cap AVX2" in lines
    # oneDNN's verbose line of the ISA it dispatches to ("onednn_verbose,v1,info,cpu,isa:...")
    assert [ln.rpartition(",isa:")[2] for ln in lines if ",isa:" in ln] == ["Intel AVX2"]
