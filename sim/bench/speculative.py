"""`python -m sim.bench.speculative`: speculative decoding's figures, nanoserve beside
llama.cpp's `llama-server` with its own n-gram speculation, on the same GGUF, both on 2
threads, in one run.

The workloads are nanoserve/workloads.py's: 36 prompts whose answers copy from the
prompt, and 16 open questions where nothing can be copied. Greedy (temperature 0) with EOS
honoured and at most --max-tokens tokens a prompt.

- batch 1: one prompt at a time, decode only (the first token to the last, prefill left
  out on both sides: llama-server's `timings.predicted_*`), speculation off and on taking
  turns prompt by prompt on one engine, so that a shared host's drift falls on both; the
  tokens of the two must be the same, prompt by prompt;
- llama-server, speculation off (`--spec-type none`) and on (`ngram-simple`, n-grams of
  --lookup tokens, --k drafted), the same prompts one at a time;
- streams (--streams, 16 by default): the first N copy prompts at once, output tokens
  over the wall time, speculation off and on.

The table at the end sets each figure beside its peer; --out writes them all as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from nanoserve.config import EngineConfig, SpeculativeConfig
from nanoserve.engine.engine import Engine
from nanoserve.model import load
from nanoserve.model.loader import embedded_path
from nanoserve.sampling.params import SamplingParams
from nanoserve.workloads import copy_prompts, open_prompts
from sim.bench.llamacpp import working_build
from sim.bench.online import stop, wait_healthy


def _decode(engine: Engine, prompt: list[int], params: SamplingParams
            ) -> tuple[list[int], float, int]:
    """One request alone: (its tokens, seconds from its first token to its last, steps)."""
    rid = engine.add_request(prompt, params)
    out: list[int] = []
    t0 = None
    first_step = engine.num_steps
    while engine.has_unfinished():
        for u in engine.step().updates:
            out.extend(u.new_token_ids)
        if t0 is None and out:
            t0 = time.perf_counter()
            first_step = engine.num_steps
    assert t0 is not None, rid
    return out, time.perf_counter() - t0, engine.num_steps - first_step


def nanoserve_batch1(engine: Engine, prompts: list[list[int]], params: SamplingParams,
                     spec: SpeculativeConfig) -> dict[str, Any]:
    """Off and on taking turns, prompt by prompt; the tokens must be the same."""
    off_cfg = dataclasses.replace(engine.config, speculative=None)
    on_cfg = dataclasses.replace(engine.config, speculative=spec)
    tokens = {"off": 0, "on": 0}
    seconds = {"off": 0.0, "on": 0.0}
    steps = {"off": 0, "on": 0}
    differ = []
    for i, p in enumerate(prompts):
        got = {}
        for label, cfg in (("off", off_cfg), ("on", on_cfg)) if i % 2 else (
                ("on", on_cfg), ("off", off_cfg)):
            engine.config = cfg
            out, s, n = _decode(engine, p, params)
            got[label] = out
            tokens[label] += len(out) - 1
            seconds[label] += s
            steps[label] += n
        if got["off"] != got["on"]:
            differ.append(i)
    engine.config = off_cfg
    rate = {k: tokens[k] / seconds[k] for k in tokens}
    return {"off_tok_s": round(rate["off"], 2), "on_tok_s": round(rate["on"], 2),
            "ratio": round(rate["on"] / rate["off"], 3), "tokens": tokens["on"],
            "tokens_per_step": round(tokens["on"] / max(steps["on"], 1), 3),
            "prompts_differing": differ}


def nanoserve_streams(engine: Engine, prompts: list[list[int]], params: SamplingParams,
                      spec: SpeculativeConfig | None) -> dict[str, float]:
    """All `prompts` at once: output tok/s over the wall time, the steps it took, and the
    rows they computed (a cost that does not drift with the host)."""
    engine.config = dataclasses.replace(engine.config, speculative=spec)
    for p in prompts:
        engine.add_request(p, params)
    t0, n, steps, rows = time.perf_counter(), 0, 0, 0
    while engine.has_unfinished():
        r = engine.step()
        n += sum(len(u.new_token_ids) for u in r.updates)
        steps += 1
        rows += r.num_prefill_tokens + r.num_decode_tokens
    return {"tok_s": round(n / (time.perf_counter() - t0), 2), "steps": steps, "rows": rows}


def llama_server(bins: Path, gguf: Path, port: int, args: argparse.Namespace, spec: bool,
                 prompts: list[str]) -> dict[str, Any]:
    cmd = [str(bins / "llama-server"), "-m", str(gguf), "-t", "2", "-np", "1", "-c", "4096",
           "--host", "127.0.0.1", "--port", str(port)]
    if spec:
        cmd += ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(args.lookup),
                "--spec-ngram-simple-size-m", str(args.k), "--spec-draft-n-max", str(args.k)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 600)
        n, ms, drafted, kept = 0, 0.0, 0, 0
        for p in prompts:
            body = json.dumps({"prompt": p, "n_predict": args.max_tokens, "temperature": 0,
                               "cache_prompt": False}).encode()
            req = urllib.request.Request(f"{url}/completion", body,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                t = json.load(r)["timings"]
            n += t["predicted_n"] - 1
            ms += t["predicted_ms"]
            drafted += t.get("draft_n", 0)
            kept += t.get("draft_n_accepted", 0)
        return {"tok_s": round(n / ms * 1000, 2), "draft": drafted, "accepted": kept}
    finally:
        stop(proc)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sim.bench.speculative")
    p.add_argument("--model", default="smollm2", choices=("smollm2", "gemma3-270m"))
    p.add_argument("--k", type=int, default=4, help="tokens proposed a step [4]")
    p.add_argument("--lookup", type=int, default=3, help="longest n-gram looked up [3]")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--no-llama", action="store_true", help="nanoserve only")
    p.add_argument("--streams", type=int, nargs="*", default=[16],
                   help="concurrent copy prompts of the throughput lines [16]")
    p.add_argument("--no-open", action="store_true", help="skip the open questions")
    p.add_argument("--no-copy", action="store_true", help="skip the copy prompts at batch 1")
    p.add_argument("--port", type=int, default=8197)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    spec = SpeculativeConfig(num_speculative_tokens=args.k, prompt_lookup_min=2,
                             prompt_lookup_max=args.lookup)
    model, tok = load(args.model)
    engine = Engine(model, tok, EngineConfig(max_model_len=2048, max_num_seqs=16))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    copy = [tok.encode_prompt(t) for t in copy_prompts()]
    open_ = [tok.encode_prompt(t) for t in open_prompts()]
    _decode(engine, copy[0], params)  # warm-up
    r: dict[str, Any] = {"model": args.model, "k": args.k, "lookup": args.lookup,
                         "date": time.strftime("%Y-%m-%d")}
    if not args.no_copy:
        r["copy"] = nanoserve_batch1(engine, copy, params, spec)
        print(f"copy, batch 1: {r['copy']}", flush=True)
    # The open answers run their full length: SmolLM2 ends some of them at once.
    if not args.no_open:
        r["open"] = nanoserve_batch1(engine, open_,
                                     dataclasses.replace(params, ignore_eos=True), spec)
        print(f"open, batch 1: {r['open']}", flush=True)
    if args.streams:  # untimed: both sides then find the prompts in the prefix cache
        nanoserve_streams(engine, copy[:max(args.streams)], params, None)
    for i, b in enumerate(args.streams):
        # Off and on take turns going first, so that the order (the host's drift, what the
        # first run left in the caches) favours neither: their work is the same by count.
        sides = [("off", None), ("on", spec)]
        got = {label: nanoserve_streams(engine, copy[:b], params, cfg)
               for label, cfg in (sides if i % 2 == 0 else sides[::-1])}
        r[f"streams{b}"] = {"off": got["off"], "on": got["on"]}
        print(f"{b} streams: {r[f'streams{b}']}", flush=True)
    s = engine.statistics().spec
    if not args.no_llama:
        gguf = embedded_path(args.model)
        bins, isa, _ = working_build("native", gguf)
        r["llama_isa"] = isa
        for label, on in (("llama_off", False), ("llama_on", True)):
            r[label] = llama_server(bins, gguf, args.port, args, on, copy_prompts())
            print(f"{label}: {r[label]}", flush=True)
        r["vs_llama_on"] = round(r["copy"]["on_tok_s"] / r["llama_on"]["tok_s"], 3)
    print(json.dumps(r), flush=True)
    if s is not None:
        print(f"nanoserve acceptance: {s.accepted_tokens}/{s.draft_tokens} proposed tokens "
              f"kept, by position {list(s.accepted_per_position)}", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(r, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
