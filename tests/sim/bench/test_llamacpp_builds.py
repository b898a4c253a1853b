"""The llama.cpp side-by-side picks a build that runs here: a native build that dies on the
host (SIGILL where the CPU's flags list instructions the VM does not enable) gives way to the
AVX2 build, and the report says so. And --model takes a GGUF file as well as a name. Fake
llama-bench scripts stand in for the builds: nothing here compiles llama.cpp."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from sim.bench import llamacpp_build
from sim.bench.llamacpp import model_arg, model_label
from sim.bench.llamacpp_build import probe, working_build
from sim.bench.llamacpp_report import report


def _fake_build(folder: Path, body: str) -> Path:
    folder.mkdir()
    bench = folder / "llama-bench"
    bench.write_text(f"#!/bin/sh\n{body}\n")
    bench.chmod(0o755)
    return folder


def test_probe_tells_a_build_that_runs_from_one_that_dies(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    assert probe(_fake_build(tmp_path / "ok", "exit 0"), gguf) is None
    died = probe(_fake_build(tmp_path / "ill", "kill -ILL $$"), gguf)
    assert died == "died with SIGILL (an instruction this CPU does not run)"
    failed = probe(_fake_build(tmp_path / "bad", "echo 'no such file' >&2; exit 1"), gguf)
    assert failed == "exited 1 (no such file)"


def test_a_native_build_that_dies_gives_way_to_the_avx2_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    builds = {"native": _fake_build(tmp_path / "native", "kill -ILL $$"),
              "avx2": _fake_build(tmp_path / "avx2", "exit 0")}
    monkeypatch.setattr(llamacpp_build, "build", builds.__getitem__)
    bins, isa, why = working_build("native", tmp_path / "m.gguf")
    assert (bins, isa) == (builds["avx2"], "avx2")
    assert why is not None
    assert why.startswith(f"the native build ({builds['native']}) died with SIGILL")
    assert "using the avx2 build" in capsys.readouterr().out

    builds["native"] = _fake_build(tmp_path / "native-ok", "exit 0")
    assert working_build("native", tmp_path / "m.gguf") == (builds["native"], "native", None)
    builds["avx2"] = builds["native"] = _fake_build(tmp_path / "both-ill", "kill -ILL $$")
    with pytest.raises(SystemExit, match="no build runs on this host"):
        working_build("avx2", tmp_path / "m.gguf")


def test_model_takes_an_embedded_name_or_a_gguf_file(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    assert model_arg("smollm2") == "smollm2"
    (tmp_path / "llama-1b-Q4_K_M.gguf").write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path)
    path = model_arg("llama-1b-Q4_K_M.gguf")
    assert path == str(tmp_path / "llama-1b-Q4_K_M.gguf")  # absolute: any folder reads it
    assert model_label(path) == "llama-1b-Q4_K_M"
    assert model_label("gemma3-270m") == "gemma3-270m"
    for bad in ("missing.gguf", "llama-1b"):
        with pytest.raises(argparse.ArgumentTypeError, match="neither an embedded model"):
            model_arg(bad)


def test_the_report_says_which_build_was_measured_when_it_fell_back() -> None:
    bench = {"isa": "avx512", "single_decode_tokens_per_s": 60.0,
             "bandwidth_bound_tokens_per_s": 120.0, "weight_mbytes": 700,
             "copy_gbytes_per_s": 12.0, "batched_decode_tokens_per_s": 150.0,
             "requests": 32, "output_tokens_per_s": 90.0, "fraction_of_mm_peak": 0.7,
             "mm2048_gflops": 140.0}
    r = {"model": "llama-1b-Q4_K_M", "isa": "native", "llamacpp_isa": "avx2",
         "llamacpp_fallback": "the native build (/c/n) died with SIGILL",
         "llama_bench": {"pp128": 300.0, "tg64": 50.0}, "nanoserve_bench": bench,
         "llama_batched_bench": {"pp_tok_s": 300.0, "tg_tok_s": 100.0},
         "rss_mib": {"auto": 300.0, "none": 900.0}}
    lines = report(r).splitlines()
    assert lines[0] == "llama-1b-Q4_K_M, --isa native: nanoserve's avx512 kernels"
    assert lines[1] == ("llama.cpp: its avx2 build measured, not --isa native's: the native "
                        "build (/c/n) died with SIGILL")
    assert "nanoserve 60.0, llama-bench tg64 50.0 (1.20x)" in lines[2]
    del r["llamacpp_isa"], r["llamacpp_fallback"]
    assert not any(line.startswith("llama.cpp:") for line in report(r).splitlines())
