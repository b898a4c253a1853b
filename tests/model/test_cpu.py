"""Which instruction sets run here (model/cpu.py, model/native.py): what the CPU advertises
less what the OS has not enabled (XCR0), oneDNN held to the same, and `auto`'s choice
between the sets this machine runs, measured once and cached. Every fact is injected, so
each case runs on any host; one test reads this host's own XCR0."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

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


# ---- auto: the faster set, measured once and cached -------------------------------------

class FakeMeasure:
    """Stands in for the timing: fixed seconds by set, and a count of the calls."""

    def __init__(self, seconds: Mapping[str, float]) -> None:
        self.seconds = dict(seconds)
        self.calls = 0

    def __call__(self, candidates: Sequence[str]) -> dict[str, float]:
        self.calls += 1
        return {c: self.seconds[c] for c in candidates if c in self.seconds}


KEY = "Intel(R) Xeon(R) Platinum 8480+|flags=0123456789abcdef|kernels=fedcba9876543210"
BOTH = ("avx512", "avx2")


@pytest.mark.parametrize(("seconds", "chosen"), [
    ({"avx512": 0.0100, "avx2": 0.0098}, "avx512"),  # 2% faster: a tie, the wider kept
    ({"avx512": 0.0100, "avx2": 0.0096}, "avx2"),  # 4% faster
    ({"avx512": 0.0090, "avx2": 0.0100}, "avx512"),
])
def test_the_narrower_set_wins_only_by_more_than_3_percent(seconds: dict[str, float],
                                                           chosen: str) -> None:
    assert native.faster(seconds, BOTH) == chosen


def test_a_measured_choice_is_cached_and_reused_without_measuring(tmp_path: Path) -> None:
    path = tmp_path / "native" / native.CHOICE_FILE
    measure = FakeMeasure({"avx512": 0.0125, "avx2": 0.0100})
    assert native.choose_isa(BOTH, KEY, path, measure) == "avx2"
    assert json.loads(path.read_text()) == {"version": 1, "choices": {
        KEY: {"isa": "avx2", "ms": {"avx512": 12.5, "avx2": 10.0}}}}
    assert native.choose_isa(BOTH, KEY, path, measure) == "avx2"
    assert measure.calls == 1


def test_one_candidate_or_one_loaded_build_is_not_measured_or_kept(tmp_path: Path) -> None:
    path = tmp_path / native.CHOICE_FILE
    measure = FakeMeasure({"avx2": 0.01})
    assert native.choose_isa(("avx2",), KEY, path, measure) == "avx2"
    assert measure.calls == 0
    assert native.choose_isa(BOTH, KEY, path, measure) == "avx2"  # avx512 failed to build
    assert measure.calls == 1
    assert not path.exists()


def test_another_cpu_model_flags_or_kernel_build_measures_again(tmp_path: Path) -> None:
    path = tmp_path / native.CHOICE_FILE
    measure = FakeMeasure({"avx512": 0.01, "avx2": 0.02})
    other_model = KEY.replace("8480+", "8592+")
    other_flags = KEY.replace("flags=0123", "flags=4567")
    other_kernels = KEY.replace("kernels=fedc", "kernels=ba98")
    for n, key in enumerate((KEY, other_model, other_flags, other_kernels), start=1):
        assert native.choose_isa(BOTH, key, path, measure) == "avx512"
        assert measure.calls == n
    # Another build of the kernels replaces its CPU's stale entry; other CPUs' stay.
    assert sorted(json.loads(path.read_text())["choices"]) == sorted(
        [other_model, other_flags, other_kernels])


@pytest.mark.parametrize("text", [
    "{not json",
    "[]",
    '{"version": 1, "choices": []}',
    json.dumps({"version": 1, "choices": {KEY: {"isa": "sse9", "ms": {}}}}),
    json.dumps({"version": 1, "choices": {KEY: {"isa": "avx2", "ms": {"avx2": "fast"}}}}),
])
def test_a_corrupt_cache_file_is_measured_again_not_trusted(tmp_path: Path, text: str) -> None:
    path = tmp_path / native.CHOICE_FILE
    path.write_text(text)
    measure = FakeMeasure({"avx512": 0.01, "avx2": 0.02})
    assert native.choose_isa(BOTH, KEY, path, measure) == "avx512"
    assert measure.calls == 1
    assert json.loads(path.read_text())["choices"][KEY] == {
        "isa": "avx512", "ms": {"avx512": 10.0, "avx2": 20.0}}


def test_processes_measure_one_at_a_time_and_the_later_take_the_first_ones_choice(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / native.CHOICE_FILE
    with native._locked(path.with_suffix(".lock")):  # the lock is exclusive between opens
        fd = os.open(path.with_suffix(".lock"), os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def another_process_measures_first(lock: Path) -> Iterator[None]:
        path.write_text(json.dumps({"version": 1, "choices": {
            KEY: {"isa": "avx2", "ms": {"avx512": 2.0, "avx2": 1.0}}}}))
        yield

    monkeypatch.setattr(native, "_locked", another_process_measures_first)
    measure = FakeMeasure({"avx512": 0.01, "avx2": 0.02})
    assert native.choose_isa(BOTH, KEY, path, measure) == "avx2"
    assert measure.calls == 0


@pytest.mark.skipif(platform.machine() != "x86_64", reason="an x86-64 host's choice")
def test_nanoserve_isa_overrides_the_cached_choice(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        native._compiler()
    except RuntimeError:
        pytest.skip("the libraries' names need the compiler command")
    facts = cpu.CpuFacts(SPR_FLAGS, ALL_STATE, True, "Test CPU")
    monkeypatch.setattr(cpu, "host", lambda: facts)
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    monkeypatch.delenv("NANOSERVE_ISA", raising=False)
    monkeypatch.delenv("NANOSERVE_NATIVE", raising=False)

    def no_measuring(candidates: Sequence[str]) -> dict[str, float]:
        raise AssertionError("measured despite a cached choice")

    monkeypatch.setattr(native, "_measure_decode", no_measuring)
    key = native._auto_key(tmp_path, BOTH)
    assert key.startswith(f"Test CPU|flags={facts.digest()}|kernels=")
    (tmp_path / "native").mkdir()
    (tmp_path / "native" / native.CHOICE_FILE).write_text(json.dumps(
        {"version": 1, "choices": {key: {"isa": "avx2", "ms": {"avx512": 2.0, "avx2": 1.0}}}}))
    try:
        assert native.isa() == "avx2"
        for forced in ("avx512", "generic"):
            monkeypatch.setenv("NANOSERVE_ISA", forced)
            assert native.isa() == forced
    finally:
        native._auto_isa.cache_clear()  # holds this test's folder and fake CPU


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
    lines = _onednn_verbose(code).splitlines()
    assert "cap AVX2" in lines
    if not _onednn_runs_int_mm():
        pytest.skip("PyTorch's torch._int_mm does not call oneDNN on this CPU (it does where "
                    "the CPU has AVX-512 VNNI): no oneDNN code to cap here")
    # oneDNN's verbose line of the ISA it dispatches to ("onednn_verbose,v1,info,cpu,isa:...")
    assert [ln.rpartition(",isa:")[2] for ln in lines if ",isa:" in ln] == ["Intel AVX2"]


def _onednn_runs_int_mm() -> bool:
    """Whether torch._int_mm reaches oneDNN on the real CPU: on a Zen 3 (AVX2, no VNNI) it
    runs PyTorch's own loop, and oneDNN prints no verbose line."""
    return ",isa:" in _onednn_verbose("import torch\n"
                                      "torch._int_mm(torch.ones(32, 64, dtype=torch.int8), "
                                      "torch.ones(64, 32, dtype=torch.int8))\n")


def _onednn_verbose(code: str) -> str:
    """`code`'s output in a fresh process with oneDNN's verbose lines and no ISA cap set."""
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA",
                                                            "DNNL_MAX_CPU_ISA")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**env, "ONEDNN_VERBOSE": "1"}, check=True, timeout=300)
    return done.stdout
