"""`python -m sim.bench.llamacpp` (`just bench-llamacpp`): nanoserve beside llama.cpp on the
same GGUF file, in one run on this machine.

llama.cpp's binaries are built once from the llama.cpp that the llama-cpp-python sdist on
PyPI vendors (scripts/build_llamacpp.sh; a while on 2 cores, then cached). Then, with both
on 2 threads:

- batch-1 decode: `llama-bench -t 2 -p 128 -n 64` against `nanoserve bench`'s batch-1 line,
  with the bound it is measured against (quantized weight bytes over the bandwidth of a
  large copy, measured in the same process), and the offline figure beside it;
- 16 sequences: `llama-batched-bench -npp 128 -ntg 64 -npl 16`'s decode (TG) against
  `nanoserve bench`'s batched decode line, the same shape with prefill excluded on both,
  and against the offline `nanoserve bench --n 32` figure, which counts its prefill;
- online, streaming, 128-token prompts and 64 output tokens: `sim bench` at 1 and at 16
  concurrent clients against `llama-server -np 16` and `nanoserve serve`, one server at a
  time, in `--rounds` alternating rounds; and GuideLLM against both where
  `just guidellm-setup` has run;
- memory: `nanoserve serve`'s resident set (its /metrics process collector) after one
  request, with the GGUF's blocks and with float32 weights.

`--model` takes an embedded model's name or any GGUF file nanoserve reads, e.g. the
random-weight Llamas of 0.5B to 3B parameters that scripts/make_synthetic_gguf.py writes (a
speed-only yardstick: their tokens are noise); both run the same file.

Each llama.cpp build is probed before use (a tiny `llama-bench` on the file): a native build
can die on a host whose CPU flags list instructions the VM does not enable (SIGILL: AMX on
one Intel host). Then the run says so, in its output and its report, and measures llama.cpp's
AVX2 build instead, nanoserve still at its best.

`--isa avx2` makes the comparison on AVX2 on any host: llama.cpp built with AVX2, FMA and
F16C and AVX-512 off (`build_llamacpp.sh avx2`, cached apart), and nanoserve run with
NANOSERVE_ISA=avx2 and PyTorch's own libraries held to AVX2 as well (MKL's sgemm, oneDNN's
int8 GEMM, ATen's vectorized ops), so that no multiply of nanoserve's uses an instruction
llama.cpp's build was denied. `--isa native` (the default) is each at its best on this CPU.

Every figure goes to --out-dir as JSON; the table at the end sets each beside its peer.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from nanoserve.model.loader import EMBEDDED, embedded_path
from sim.bench.guidellm import GUIDELLM, guidellm_command, offline_env, summarize
from sim.bench.online import stop, wait_healthy
from sim.files import atomic_write_text

PY = sys.executable


def build(isa: str) -> Path:
    out = subprocess.run(["bash", "scripts/build_llamacpp.sh", isa], check=True,
                         stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHON": PY})
    return Path(out.stdout.strip().splitlines()[-1])


PROBE_TIMEOUT_S = 600


def probe(bins: Path, gguf: Path) -> str | None:
    """None where the build in `bins` runs `gguf` on this host, else how it fails: a tiny
    `llama-bench` (8 prompt tokens, 1 generated) loads the file and runs the matrix kernels
    the measurements will, so a build with instructions this CPU lacks dies here, not midway."""
    cmd = [str(bins / "llama-bench"), "-m", str(gguf), "-t", "2", "-p", "8", "-n", "1",
           "-r", "1"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"ran past {PROBE_TIMEOUT_S} s on an 8-token probe"
    except OSError as exc:
        return f"could not start ({exc})"
    if done.returncode < 0:
        try:
            name = signal.Signals(-done.returncode).name
        except ValueError:
            name = f"signal {-done.returncode}"
        return f"died with {name}" + (" (an instruction this CPU does not run)"
                                      if name == "SIGILL" else "")
    if done.returncode > 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return f"exited {done.returncode} ({last})"
    return None


def working_build(isa: str, gguf: Path) -> tuple[Path, str, str | None]:
    """The llama.cpp build to measure: (its folder, its ISA, why it is not `isa`'s or None).
    `--isa native` falls back to the AVX2 build where the native one fails to build or dies
    on this host; `--isa avx2` has nothing to fall back to."""
    candidates = (isa, "avx2") if isa == "native" else (isa,)
    failures: list[str] = []
    for b in candidates:
        try:
            bins = build(b)
        except subprocess.CalledProcessError as exc:
            why = f"the {b} build failed (build_llamacpp.sh exited {exc.returncode})"
        else:
            failure = probe(bins, gguf)
            if failure is None:
                return bins, b, "; ".join(failures) or None
            why = f"the {b} build ({bins}) {failure}"
        failures.append(why)
        more = "; using the avx2 build" if b != candidates[-1] else ""
        print(f"llama.cpp: {why}{more}", flush=True)
    raise SystemExit(f"llama.cpp: no build runs on this host: {'; '.join(failures)}")


def model_arg(value: str) -> str:
    """--model: an embedded model's name, or a GGUF file (as an absolute path, so that every
    process, from any folder, reads the same file)."""
    if value in EMBEDDED:
        return value
    path = Path(value).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return str(path.resolve())
    raise argparse.ArgumentTypeError(
        f"{value!r} is neither an embedded model ({', '.join(EMBEDDED)}) nor a .gguf file")


def model_label(model: str) -> str:
    """The model's name in the report and the result's file name: a file's stem."""
    return model if model in EMBEDDED else Path(model).stem


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
    subprocess.run([PY, "-m", "sim.cli", "bench", "--url", url, "--label", label,
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sim.bench.llamacpp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1, help="alternating online rounds [1]")
    ap.add_argument("--n16", type=int, default=64, help="requests at 16 clients [64]")
    ap.add_argument("--n1", type=int, default=8, help="requests at 1 client [8]")
    ap.add_argument("--port", type=int, default=8130)
    ap.add_argument("--no-guidellm", action="store_true")
    ap.add_argument("--out-dir", default="bench/results")
    ap.add_argument("--isa", choices=("native", "avx2"), default="native",
                    help="native: each at its best here; avx2: both built or forced to AVX2")
    ap.add_argument("--offline-n", type=int, default=32,
                    help="requests of the offline `nanoserve bench --n` [32]")
    ap.add_argument("--int8-activations", action="store_true",
                    help="also nanoserve with --int8-activations, offline and online")
    ap.add_argument("--model", type=model_arg, default=EMBEDDED[0],
                    help=f"what both run: an embedded model ({', '.join(EMBEDDED)}), from its "
                         "one GGUF file, or a GGUF file's path [smollm2]")
    a = ap.parse_args(argv)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gguf = embedded_path(a.model) if a.model in EMBEDDED else Path(a.model)
    label = model_label(a.model)
    bins, llamacpp_isa, fallback = working_build(a.isa, gguf)
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}, load average {os.getloadavg()}; "
          f"{gguf.name}; llama.cpp from {bins}; --isa {a.isa}", flush=True)
    r: dict[str, Any] = {"model": label, "isa": a.isa, "gguf": str(gguf)}
    if fallback:
        r["llamacpp_isa"], r["llamacpp_fallback"] = llamacpp_isa, fallback
    r |= {"llama_bench": llama_bench(bins, gguf),
          "nanoserve_bench": nanoserve_bench(a.offline_n, a.isa, model=a.model)}
    if a.int8_activations:
        r["nanoserve_bench_int8"] = nanoserve_bench(a.offline_n, a.isa, int8=True,
                                                    model=a.model)
    print(f"batch-1 decode: llama-bench tg64 {r['llama_bench']['tg64']} tok/s, nanoserve "
          f"{r['nanoserve_bench']['single_decode_tokens_per_s']} tok/s", flush=True)
    r["llama_batched_bench"] = batched_bench(bins, gguf)
    url = f"http://127.0.0.1:{a.port}"
    use_guidellm = not a.no_guidellm and GUIDELLM.exists()
    for k in range(a.rounds):
        for kind in ("llama-server", "nanoserve",
                     *(["nanoserve-int8"] if a.int8_activations else [])):
            proc = serve(kind, bins, gguf, a.port, a.isa, model=a.model)
            try:
                model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
                for c, n in ((1, a.n1), (16, a.n16)):
                    r.setdefault("online", {}).setdefault(f"{kind} c{c}", []).append(
                        online(url, kind, c, n, out))
                    if use_guidellm:
                        r.setdefault("guidellm", {}).setdefault(f"{kind} c{c}", []).append(
                            guidellm(url, model, kind, c, n, out, tokenizer_model=a.model))
            finally:
                stop(proc)
            print(f"round {k + 1}: {kind} done", flush=True)
    r["rss_mib"] = {}
    for q in ("auto", "none"):
        proc = serve("nanoserve", bins, gguf, a.port, a.isa, quantization=q, model=a.model)
        try:
            r["rss_mib"][q] = rss_mib(url)
        finally:
            stop(proc)
    atomic_write_text(out / f"llamacpp_side_by_side_{label}_{a.isa}.json",
                      json.dumps(r, indent=1) + "\n")
    print(report(r))
    return 0


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


if __name__ == "__main__":
    sys.exit(main())
