"""`python -m sim.bench.online`: nanoserve beside Hugging Face's `transformers serve`, one run.

Starts `nanoserve serve` on the embedded SmolLM2, runs `sim bench` at a fixed concurrency
(closed loop, fixed prompt and output lengths, streaming) and the prefix-cache test, stops
it; then starts `transformers serve` on the same weights (the HF-format folder nanoserve
converted them to) and runs the same load; then prints both side by side and writes every
result as JSON. One server at a time: the machine's cores are the resource being measured.

The peer needs FastAPI and Uvicorn (`transformers[serving]`), which nanoserve's venv does
not carry; `--peer-python` names an interpreter that has them (docs/performance.md). Without one
the peer is skipped and said so. The peer rejects vLLM's `ignore_eos`, so its bodies trade
it for a `generation_config` with min_new_tokens = max_new_tokens = the output length: the
same number of tokens, which the results' usage counts confirm.
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
import trio

from sim.bench import bench_command
from sim.files import atomic_write_text

ROWS = [  # (label, summary key, distribution key or None)
    ("completed", "completed", None), ("failed", "failed", None),
    ("duration s", "duration_s", None), ("requests/s", "request_throughput", None),
    ("output tok/s", "output_throughput", None),
    ("TTFT p50 ms", "ttft_ms", "p50"), ("TTFT p99 ms", "ttft_ms", "p99"),
    ("TPOT p50 ms", "tpot_ms", "p50"), ("TPOT p99 ms", "tpot_ms", "p99"),
    ("ITL p50 ms", "itl_ms", "p50"), ("E2E p50 ms", "e2e_ms", "p50"),
    ("E2E p99 ms", "e2e_ms", "p99"),
]  # fmt: skip


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Poll GET /health until it answers 200 (the weights are loaded)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(0.5)
    raise RuntimeError(f"{url} not healthy after {timeout_s} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def bench(argv: list[str]) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    bench_command.add_parser(p.add_subparsers())
    result: dict[str, Any] = trio.run(bench_command.run_bench, p.parse_args(["bench", *argv]))
    print(bench_command.format_summary(result), flush=True)
    return result


def prefix_test(url: str, max_ratio: float) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    bench_command.add_parser(p.add_subparsers())
    a = p.parse_args(["bench", "--url", url, "--prefix-test", "--max-ratio", str(max_ratio)])
    res, _, _ = trio.run(bench_command.run_prefix, a)
    out: dict[str, Any] = res.to_json()
    print(f"prefix test: cold TTFT {out['cold_ttft_ms']} ms, warm {out['warm_ttft_ms']} ms, "
          f"median warm / cold {out['ratio']} (must be <= {max_ratio})", flush=True)
    return out


def side_by_side(results: dict[str, dict[str, Any]]) -> str:
    names = list(results)
    lines = [f"{'':<14}" + "".join(f"{n:>22}" for n in names)]
    for label, key, sub in ROWS:
        cells = []
        for n in names:
            v = results[n]["summary"].get(key)
            v = v.get(sub) if isinstance(v, dict) and sub else v
            cells.append(f"{'-' if v is None else v:>22}")
        lines.append(f"{label:<14}" + "".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sim.bench.online", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--model", default="smollm2", help="nanoserve's --model [smollm2]")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--peer-port", type=int, default=8124)
    ap.add_argument("--peer-python", default=os.environ.get("PEER_PYTHON"),
                    help="an interpreter with transformers[serving] [$PEER_PYTHON]")
    ap.add_argument("--peer-args", default="", help="extra `transformers serve` flags")
    ap.add_argument("--peer-n", type=int, help="requests for the peer [--n]; it serves one "
                    "request at a time, so a shorter run tells the same story sooner")
    ap.add_argument("--no-nanoserve", action="store_true", help="run the peer only")
    ap.add_argument("--max-ratio", type=float, default=0.25)
    ap.add_argument("--out-dir", default="bench/results")
    a = ap.parse_args(argv)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shape = ["--concurrency", str(a.concurrency), "--prompt", f"fixed:{a.prompt_tokens}",
             "--output", f"fixed:{a.output_tokens}", "--details"]
    load = [*shape, "--n", str(a.n)]
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}, load average {os.getloadavg()}",
          flush=True)
    results: dict[str, dict[str, Any]] = {}

    prefix: dict[str, Any] | None = None
    if not a.no_nanoserve:
        results["nanoserve"], prefix = run_nanoserve(a, load)
        save(out, "nanoserve", results["nanoserve"])
        save(out, "prefix", prefix)

    peer = peer_command(a)
    if peer is None:
        print("peer skipped: no --peer-python (or $PEER_PYTHON) with fastapi and uvicorn")
    else:
        purl = f"http://127.0.0.1:{a.peer_port}"
        proc = subprocess.Popen(peer, stdout=subprocess.DEVNULL)
        try:
            wait_healthy(purl, proc, 600)
            gen = {"min_new_tokens": a.output_tokens, "max_new_tokens": a.output_tokens,
                   "do_sample": False}
            extra = {"ignore_eos": None, "generation_config": json.dumps(gen)}
            # Its /v1/models fails (500), and it answers only to the folder's path.
            results["transformers serve"] = bench(["--url", purl, "--model", peer[4],
                                                   "--label", "transformers serve",
                                                   "--extra-body", json.dumps(extra), *shape,
                                                   "--n", str(a.peer_n or a.n)])
            save(out, "transformers_serve", results["transformers serve"])
        finally:
            stop(proc)
    print(side_by_side(results))
    ok = True
    if prefix is not None:
        print(f"prefix cache: warm/cold TTFT {prefix['ratio']} (cold {prefix['cold_ttft_ms']} "
              "ms)")
        ok = prefix["ratio"] is not None and prefix["ratio"] <= a.max_ratio
    return 0 if ok and all(r["summary"]["failed"] == 0 for r in results.values()) else 1


def save(out: Path, name: str, result: dict[str, Any]) -> None:
    """Written as soon as it exists: a peer run that is cut short loses only itself."""
    atomic_write_text(out / f"{name}.json", json.dumps(result, indent=1) + "\n")


def run_nanoserve(a: argparse.Namespace, load: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    url = f"http://127.0.0.1:{a.port}"
    proc = subprocess.Popen([sys.executable, "-m", "nanoserve.cli", "serve", "--model",
                             a.model, "--port", str(a.port), "--log-level", "warning"])
    try:
        wait_healthy(url, proc, 600)
        result = bench(["--url", url, "--label", "nanoserve", *load])
        return result, prefix_test(url, a.max_ratio)
    finally:
        stop(proc)


def peer_command(a: argparse.Namespace) -> list[str] | None:
    if not a.peer_python:
        return None
    probe = subprocess.run([a.peer_python, "-c", "import fastapi, uvicorn, transformers"],
                           capture_output=True)
    if probe.returncode != 0:
        print(f"peer: {a.peer_python} cannot import fastapi, uvicorn and transformers:\n"
              f"{probe.stderr.decode()[-500:]}")
        return None
    from nanoserve.model.loader import ensure_float_weights, resolve_model

    ensure_float_weights(resolve_model("smollm2"))  # the peer reads the float32 folder
    return [a.peer_python, "-m", "transformers.cli.transformers", "serve",
            str(resolve_model("smollm2")), "--host", "127.0.0.1", "--port", str(a.peer_port),
            "--device", "cpu", "--dtype", "float32", *a.peer_args.split()]


if __name__ == "__main__":
    sys.exit(main())
