"""The llama.cpp side-by-side's table: each nanoserve figure beside its peer, as a ratio."""

from __future__ import annotations

from sim.bench.llamacpp_report import report


def _online(tok_s: float, p99: float) -> dict[str, float]:
    return {"output_tok_s": tok_s, "ttft_p50_ms": p99 / 2, "ttft_p99_ms": p99,
            "tpot_p50_ms": 10.0, "failed": 0}


def test_report_sets_int8_beside_the_exact_path_and_the_peer() -> None:
    bench = {"isa": "avx2", "single_decode_tokens_per_s": 60.0,
             "bandwidth_bound_tokens_per_s": 120.0, "weight_mbytes": 97,
             "copy_gbytes_per_s": 12.0, "batched_decode_tokens_per_s": 150.0,
             "requests": 32, "output_tokens_per_s": 90.0, "fraction_of_mm_peak": 0.7,
             "mm2048_gflops": 140.0}
    r = {"isa": "avx2", "llama_bench": {"pp128": 300.0, "tg64": 50.0},
         "nanoserve_bench": bench,
         "nanoserve_bench_int8": bench | {"output_tokens_per_s": 135.0},
         "llama_batched_bench": {"pp_tok_s": 300.0, "tg_tok_s": 100.0},
         "rss_mib": {"auto": 300.0, "none": 900.0},
         "online": {"llama-server c1": [_online(40.0, 100.0)],
                    "nanoserve c1": [_online(50.0, 80.0)],
                    "nanoserve-int8 c1": [_online(52.0, 70.0)],
                    "llama-server c16": [_online(100.0, 900.0)],
                    "nanoserve c16": [_online(130.0, 800.0)],
                    "nanoserve-int8 c16": [_online(160.0, 500.0)]}}
    lines = report(r).splitlines()
    assert lines[0] == "smollm2, --isa avx2: nanoserve's avx2 kernels"  # (the model the run names)
    assert "nanoserve 60.0, llama-bench tg64 50.0 (1.20x)" in lines[1]
    assert ("offline with --int8-activations: 135.0 output tok/s (1.35x "
            "llama-batched-bench's TG; 1.50x the exact path)") in lines
    assert ("online 16 streams: nanoserve-int8 160.0 tok/s, llama-server 100.0 (1.60x); "
            "p99 TTFT ms [500] vs [900]") in lines
    assert ("online 16 streams: nanoserve 130.0 tok/s, llama-server 100.0 (1.30x); "
            "p99 TTFT ms [800] vs [900]") in lines
