"""`python -m sim.bench.guidellm` (`just bench-guidellm`): GuideLLM against `nanoserve serve`.

GuideLLM is vLLM's own benchmark tool, so its figures are the ones a vLLM user already
reads. It lives in its own interpreter (`just guidellm-setup`: .venv/guidellm, which sees
nanoserve's packages, torch pin included, through a .pth file, and adds GuideLLM's own), and
runs offline: its tokenizer is the folder nanoserve converted the embedded model into, and
its prompts are its own synthetic text. For each `--streams` value this starts
`nanoserve serve`, runs a fixed number of requests at that many concurrent streams (closed
loop, chat completions, streaming, GuideLLM's defaults), stops the server, and prints
GuideLLM's TTFT, ITL and throughput; its full console report and JSON go to `--out-dir`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from sim.bench.online import stop, wait_healthy

GUIDELLM = Path(".venv/guidellm/bin/guidellm")


def guidellm_command(
    url: str, model: str, tokenizer: Path, *, streams: int, requests: int,
    prompt_tokens: int, output_tokens: int, out_json: Path,
) -> list[str]:
    return [
        str(GUIDELLM), "run",
        "--backend", f"kind=openai_http,target={url},model={model}",
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
        "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},"
                  f"output_tokens={output_tokens}",
        "--profile", f"kind=concurrent,streams={streams}",
        "--constraint", f"kind=max_requests,count={requests}",
        "--output", f"kind=json,path={out_json}",
        "--disable-progress",
    ]  # fmt: skip


def offline_env() -> dict[str, str]:
    """No hub: every file GuideLLM reads is on this machine."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """The figures of GuideLLM's one benchmark in `report` (its JSON output)."""
    (b,) = report["benchmarks"]
    m = b["metrics"]

    def stat(name: str, key: str) -> float:
        s = m[name]["successful"]
        return float(s["percentiles"][key] if key.startswith("p") else s[key])

    totals = m["request_totals"]
    return {
        "successful": totals["successful"], "errored": totals["errored"],
        "incomplete": totals["incomplete"], "duration_s": round(b["duration"], 2),
        "requests_per_s": round(stat("requests_per_second", "mean"), 3),
        "output_tok_per_s": round(stat("output_tokens_per_second", "mean"), 1),
        "ttft_ms_p50": round(stat("time_to_first_token_ms", "median"), 1),
        "ttft_ms_p99": round(stat("time_to_first_token_ms", "p99"), 1),
        "itl_ms_p50": round(stat("inter_token_latency_ms", "median"), 2),
        "itl_ms_p99": round(stat("inter_token_latency_ms", "p99"), 2),
    }  # fmt: skip


def table(rows: dict[str, dict[str, Any]]) -> str:
    keys = list(next(iter(rows.values())))
    lines = [f"{'':<18}" + "".join(f"{k:>14}" for k in rows)]
    lines += [f"{key:<18}" + "".join(f"{r[key]:>14}" for r in rows.values()) for key in keys]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sim.bench.guidellm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="nanoserve's --model [smollm2]")
    ap.add_argument("--streams", default="1,16", help="concurrent streams, one run each")
    ap.add_argument("--requests", default="16,64", help="requests per run, one per --streams")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--port", type=int, default=8125)
    ap.add_argument("--out-dir", default="bench/results")
    a = ap.parse_args(argv)
    if not GUIDELLM.exists():
        print(f"{GUIDELLM} is missing: run `just guidellm-setup`", file=sys.stderr)
        return 2
    streams = [int(s) for s in a.streams.split(",")]
    counts = [int(n) for n in a.requests.split(",")]
    if len(counts) != len(streams):
        ap.error("--requests needs one count per --streams value")
    from nanoserve.model.loader import resolve_model

    tokenizer = resolve_model("smollm2")  # the stub speaks SmolLM2's vocabulary too
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}, load average {os.getloadavg()}",
          flush=True)
    rows: dict[str, dict[str, Any]] = {}
    for n_streams, n_requests in zip(streams, counts, strict=True):
        url = f"http://127.0.0.1:{a.port}"
        server = subprocess.Popen([sys.executable, "-m", "nanoserve.cli", "serve", "--model",
                                   a.model, "--port", str(a.port), "--log-level", "warning"])
        report = out / f"guidellm_{a.model}_{n_streams}streams.json"
        try:
            wait_healthy(url, server, 600)
            cmd = guidellm_command(url, a.model, tokenizer, streams=n_streams,
                                   requests=n_requests, prompt_tokens=a.prompt_tokens,
                                   output_tokens=a.output_tokens, out_json=report)
            with open(out / f"guidellm_{a.model}_{n_streams}streams.txt", "w") as console:
                subprocess.run(cmd, check=True, env=offline_env(), stdout=console,
                               stderr=subprocess.STDOUT)
        finally:
            stop(server)
        rows[f"{n_streams} stream{'s' if n_streams > 1 else ''}"] = summarize(
            json.loads(report.read_text()))
    print(f"GuideLLM 0.8.1 against nanoserve --model {a.model}: {a.prompt_tokens}-token "
          f"prompts, {a.output_tokens} output tokens")
    print(table(rows))
    return 0 if all(r["errored"] == 0 and r["incomplete"] == 0 for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
