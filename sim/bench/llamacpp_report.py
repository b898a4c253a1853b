"""The table at the end of `python -m sim.bench.llamacpp` (llamacpp.py): each of nanoserve's
figures beside its llama.cpp peer, as a ratio, from the run's JSON."""

from __future__ import annotations

from typing import Any


def report(r: dict[str, Any]) -> str:
    nb, lb = r["nanoserve_bench"], r["llama_bench"]
    lines = [
        f"{r.get('model', 'smollm2')}, --isa {r.get('isa', 'native')}: nanoserve's "
        f"{nb.get('isa', '?')} kernels",
        *([f"llama.cpp: its {r['llamacpp_isa']} build measured, not --isa {r.get('isa')}'s: "
           f"{r['llamacpp_fallback']}"] if r.get("llamacpp_fallback") else []),
        f"batch-1 decode tok/s: nanoserve {nb['single_decode_tokens_per_s']}, llama-bench tg64 "
        f"{lb['tg64']} ({nb['single_decode_tokens_per_s'] / lb['tg64']:.2f}x); bound "
        f"{nb['bandwidth_bound_tokens_per_s']} ({nb['single_decode_tokens_per_s'] / nb['bandwidth_bound_tokens_per_s']:.0%} of it: "  # noqa: E501
        f"{nb.get('weight_mbytes', '?')} MB at {nb['copy_gbytes_per_s']} GB/s)",
        f"prefill: llama-bench pp128 {lb['pp128']} tok/s; 16 sequences' decode, prefill "
        f"excluded: nanoserve {nb.get('batched_decode_tokens_per_s', '?')} tok/s, "
        f"llama-batched-bench TG {r['llama_batched_bench']['tg_tok_s']} tok/s",
        f"offline nanoserve bench --n {nb['requests']}: {nb['output_tokens_per_s']} output "
        f"tok/s ({nb['output_tokens_per_s'] / r['llama_batched_bench']['tg_tok_s']:.2f}x "
        f"llama-batched-bench's TG), {nb['fraction_of_mm_peak']:.0%} of a 2048 mm's "
        f"{nb['mm2048_gflops']} GFLOP/s",
        *([_int8_line(r["nanoserve_bench_int8"], r)] if "nanoserve_bench_int8" in r else []),
        f"RSS after one request, MiB: nanoserve, the GGUF's blocks {r['rss_mib']['auto']}, "
        f"float32 "
        f"{r['rss_mib']['none']}",
    ]
    for what in ("online", "guidellm"):
        runs = r.get(what)
        if not runs:
            continue
        key = "output_tok_s" if what == "online" else "output_tok_per_s"
        p99 = "ttft_p99_ms" if what == "online" else "ttft_ms_p99"
        for c in (1, 16):
            peer = runs[f"llama-server c{c}"]
            mp = sum(x[key] for x in peer) / len(peer)
            for kind in ("nanoserve", "nanoserve-int8"):
                ours = runs.get(f"{kind} c{c}")
                if not ours:
                    continue
                mo = sum(x[key] for x in ours) / len(ours)
                lines.append(
                    f"{what} {c} stream{'s' if c > 1 else ''}: {kind} {mo:.1f} tok/s, "
                    f"llama-server {mp:.1f} ({mo / mp:.2f}x); p99 TTFT ms "
                    f"{[round(x[p99]) for x in ours]} vs {[round(x[p99]) for x in peer]}")
    return "\n".join(lines)


def _int8_line(nb: dict[str, Any], r: dict[str, Any]) -> str:
    tg = r["llama_batched_bench"]["tg_tok_s"]
    return (f"offline with --int8-activations: {nb['output_tokens_per_s']} output tok/s "
            f"({nb['output_tokens_per_s'] / tg:.2f}x llama-batched-bench's TG; "
            f"{nb['output_tokens_per_s'] / r['nanoserve_bench']['output_tokens_per_s']:.2f}x "
            f"the exact path)")
