"""What `python -m sim.bench.llamacpp` runs (llamacpp.py), one process each: llama.cpp's
`llama-bench` and `llama-batched-bench`, `nanoserve bench`, a server (`llama-server` or
`nanoserve serve`) and the online clients against it (`sim bench`, GuideLLM), and the
server's resident set; nanoserve's processes held to AVX2 for `--isa avx2`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from sim.bench.guidellm import guidellm_command, offline_env, summarize
from sim.bench.online import wait_healthy

PY = sys.executable


# What holds nanoserve and the libraries under it to AVX2 (each library's own switch).
AVX2_ENV = {"NANOSERVE_ISA": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
            "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


def nanoserve_env(isa: str) -> dict[str, str]:
    """nanoserve's environment: AVX2 throughout for `--isa avx2`, else the CPU's best."""
    env = {k: v for k, v in os.environ.items() if k not in AVX2_ENV}
    return env | AVX2_ENV if isa == "avx2" else env


def llama_bench(bins: Path, gguf: Path) -> dict[str, float]:
    out = subprocess.run([str(bins / "llama-bench"), "-m", str(gguf), "-t", "2", "-p", "128",
                          "-n", "64", "-o", "json"], check=True, capture_output=True, text=True)
    rows = json.loads(out.stdout)
    return {("pp128" if r["n_prompt"] else "tg64"): round(float(r["avg_ts"]), 2) for r in rows}


def batched_bench(bins: Path, gguf: Path) -> dict[str, float]:
    out = subprocess.run([str(bins / "llama-batched-bench"), "-m", str(gguf), "-t", "2",
                          "-c", "4096", "-npp", "128", "-ntg", "64", "-npl", "16"],
                         check=True, capture_output=True, text=True)
    row = next(line for line in out.stdout.splitlines() if line.startswith("|   128"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    return {"pp_tok_s": float(cells[5]), "tg_tok_s": float(cells[7])}


def nanoserve_bench(n: int, isa: str, int8: bool = False, model: str = "smollm2"
                    ) -> dict[str, Any]:
    flag = ["--int8-activations"] if int8 else []
    out = subprocess.run([PY, "-m", "nanoserve.cli", "bench", "--model", model, "--n", str(n),
                          "--quiet", *flag],
                         check=True, capture_output=True, text=True, env=nanoserve_env(isa))
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def serve(kind: str, bins: Path, gguf: Path, port: int, isa: str, quantization: str = "auto",
          model: str = "smollm2") -> subprocess.Popen[bytes]:
    if kind == "llama-server":
        cmd = [str(bins / "llama-server"), "-m", str(gguf), "-t", "2", "-np", "16", "-c", "4096",
               "--host", "127.0.0.1", "--port", str(port)]
    else:
        cmd = [PY, "-m", "nanoserve.cli", "serve", "--model", model, "--port", str(port),
               "--log-level",
               "warning", "--quantization", quantization,
               *(["--int8-activations"] if kind == "nanoserve-int8" else [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=nanoserve_env(isa))
    wait_healthy(f"http://127.0.0.1:{port}", proc, 600)
    return proc


def online(url: str, label: str, concurrency: int, n: int, out: Path) -> dict[str, Any]:
    path = out / f"online_{label}_{concurrency}.json"
    subprocess.run([PY, "-m", "sim.commands", "bench", "--url", url, "--label", label,
                    "--concurrency", str(concurrency), "--n", str(n), "--prompt", "fixed:128",
                    "--output", "fixed:64", "--out", str(path)], check=True,
                   stdout=subprocess.DEVNULL)
    s = json.loads(path.read_text())["summary"]
    return {"output_tok_s": s["output_throughput"], "ttft_p50_ms": s["ttft_ms"]["p50"],
            "ttft_p99_ms": s["ttft_ms"]["p99"], "tpot_p50_ms": s["tpot_ms"]["p50"],
            "failed": s["failed"]}


def guidellm(url: str, model: str, label: str, streams: int, n: int, out: Path,
             tokenizer_model: str = "smollm2") -> dict[str, Any]:
    from nanoserve.model.loader import resolve_model

    report = out / f"guidellm_{label}_{streams}.json"
    cmd = guidellm_command(url, model, resolve_model(tokenizer_model), streams=streams,
                           requests=n,
                           prompt_tokens=128, output_tokens=64, out_json=report)
    subprocess.run(cmd, check=True, env=offline_env(), stdout=subprocess.DEVNULL,
                   stderr=subprocess.STDOUT)
    return summarize(json.loads(report.read_text()))


def rss_mib(url: str) -> float:
    """The server's resident set after one request, from its /metrics process collector."""
    httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 8}, timeout=120)
    text = httpx.get(f"{url}/metrics", timeout=30).text
    line = next(ln for ln in text.splitlines() if ln.startswith("process_resident_memory_bytes"))
    return round(float(line.split()[-1]) / 2**20, 1)
