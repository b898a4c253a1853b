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
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from nanoserve.model.loader import EMBEDDED, embedded_path
from sim.bench.guidellm import GUIDELLM

# Re-exported as well as used: sim/bench/speculative.py picks its llama.cpp build with it.
from sim.bench.llamacpp_build import working_build as working_build
from sim.bench.llamacpp_report import report
from sim.bench.llamacpp_runs import (
    batched_bench,
    guidellm,
    llama_bench,
    nanoserve_bench,
    online,
    rss_mib,
    serve,
)
from sim.bench.online import stop
from sim.files import atomic_write_text


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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
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
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
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
    r |= offline(a, bins, gguf)
    url = f"http://127.0.0.1:{a.port}"
    online_rounds(r, a, bins, gguf, out, url)
    r["rss_mib"] = resident_sets(a, bins, gguf, url)
    atomic_write_text(out / f"llamacpp_side_by_side_{label}_{a.isa}.json",
                      json.dumps(r, indent=1) + "\n")
    print(report(r))
    return 0


def offline(a: argparse.Namespace, bins: Path, gguf: Path) -> dict[str, Any]:
    """The figures without a server: llama-bench, `nanoserve bench` (and with int8
    activations where asked), then llama-batched-bench, in the order the report keeps."""
    r: dict[str, Any] = {"llama_bench": llama_bench(bins, gguf),
                         "nanoserve_bench": nanoserve_bench(a.offline_n, a.isa, model=a.model)}
    if a.int8_activations:
        r["nanoserve_bench_int8"] = nanoserve_bench(a.offline_n, a.isa, int8=True,
                                                    model=a.model)
    print(f"batch-1 decode: llama-bench tg64 {r['llama_bench']['tg64']} tok/s, nanoserve "
          f"{r['nanoserve_bench']['single_decode_tokens_per_s']} tok/s", flush=True)
    r["llama_batched_bench"] = batched_bench(bins, gguf)
    return r


def online_rounds(r: dict[str, Any], a: argparse.Namespace, bins: Path, gguf: Path, out: Path,
                  url: str) -> None:
    """`--rounds` rounds of each server in turn, one at a time, at 1 and at 16 clients: each
    run appended to r's "online" (and "guidellm") under "<server> c<clients>". Alternating,
    so that a shared host's drift falls on every server alike."""
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


def resident_sets(a: argparse.Namespace, bins: Path, gguf: Path, url: str) -> dict[str, float]:
    """`nanoserve serve`'s resident set after one request, MiB: with the GGUF's blocks
    ("auto") and with float32 weights ("none")."""
    rss: dict[str, float] = {}
    for q in ("auto", "none"):
        proc = serve("nanoserve", bins, gguf, a.port, a.isa, quantization=q, model=a.model)
        try:
            rss[q] = rss_mib(url)
        finally:
            stop(proc)
    return rss


if __name__ == "__main__":
    sys.exit(main())
