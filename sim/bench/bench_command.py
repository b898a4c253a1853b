"""`sim bench`: the online load client (in the style of vLLM's `bench serve`).

  sim bench --url URL [--concurrency N] [--load SPEC | --trace TRACE] [--n N --prompt L
            --output L --arrival KIND --rate R ...] [--slo ttft=2s,tpot=200ms] [--out JSON]
  sim bench --url URL --prefix-test [--prefix-tokens 1000] [--prefix-n 5] [--max-ratio 0.25]

Requests come from a synthetic load (`--load` and the flags, the same spec as `sim load`;
without one, 64 requests of 128 prompt and 64 output tokens) or from a trace file. They are
sent at their arrival times (open loop) or, with `--concurrency N`, by N clients in a closed
loop. Every body is sent to the server's own model name (`--model`, or the first of
/v1/models) and streamed unless `--no-stream`; `--extra-body JSON` merges keys into every
body, a null removing one (a peer that rejects vLLM's `ignore_eos` gets
`{"ignore_eos": null, ...}`). Metric definitions: sim.bench.records.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from typing import Any

import httpx
import trio

from nanoserve import flags
from sim.bench.client import (
    BenchRequest,
    make_client,
    prepare_body,
    run_load,
    send_one,
    served_model,
)
from sim.bench.prefix import PrefixResult, fresh_seed, prefix_requests, run_prefix_test
from sim.bench.records import parse_slo, summarize
from sim.cli_util import add_trace_args, guarded, tokenizer, trace_options
from sim.files import atomic_write_text
from sim.load.azure import PromptSynth
from sim.load.public import detect_format, read_public_trace, text_trace, window
from sim.load.spec import load_spec_from_pairs, split_load_spec
from sim.load.synthetic import generate_load
from sim.trace.format import Trace
from sim.trace.loader import load_trace

RESULT_VERSION = 1
# Flags laid over --load, as in `sim load`; DEFAULTS fill what neither gives.
_LOAD_FLAGS = ("n", "arrival", "rate", "burstiness", "prompt", "output", "shared_prefix",
               "api", "seed")
DEFAULTS = {"n": "64", "prompt": "fixed:128", "output": "fixed:64"}


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="load an OpenAI-compatible server; latency and "
                       "throughput", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server [%(default)s]")
    p.add_argument("--model", help="the model name to send [the first of /v1/models]")
    p.add_argument("--label", help="a name for this server in the result [the URL]")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--load", metavar="SPEC", help="a `sim load` spec")
    src.add_argument("--trace", type=flags.input_file, metavar="TRACE",
                     help="send a trace's requests: a nanoserve virtual-clock trace, or a "
                     "public one (Mooncake, Alibaba, BurstGPT, Azure), prefix-faithful")
    for key in _LOAD_FLAGS:
        p.add_argument("--" + key.replace("_", "-"), dest=key, metavar=key.upper())
    add_trace_args(p, flag=False)
    p.add_argument("--concurrency", type=flags.positive_int, metavar="N",
                   help="closed loop: N requests always in flight; arrival times ignored")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="stream the responses [yes]")
    p.add_argument("--extra-body", metavar="JSON", help="keys merged into every body")
    p.add_argument("--warmup", type=flags.non_negative_int, default=1, metavar="N",
                   help="send the first request N times, unmeasured, before the load [1]")
    p.add_argument("--slo", metavar="K=DUR,...", help="goodput thresholds per request: "
                   "ttft, tpot, e2e, e.g. ttft=2s,tpot=200ms")
    p.add_argument("--tokenizer", default="smollm2",
                   help="whose tokenizer sizes synthetic prompts [%(default)s]")
    p.add_argument("--out", type=flags.output_file, metavar="JSON", help="write the result here")
    p.add_argument("--details", action="store_true", help="per-request records in --out")
    g = p.add_argument_group("prefix-cache test")
    g.add_argument("--prefix-test", action="store_true",
                   help="cold vs warm TTFT of chats sharing a system prompt")
    g.add_argument("--prefix-tokens", type=flags.positive_int, default=1000)
    g.add_argument("--prefix-n", type=flags.positive_int, default=5, help="requests sharing it [5]")
    g.add_argument("--max-ratio", type=flags.positive_float,
                   help="exit 1 if warm/cold TTFT exceeds this")
    p.set_defaults(main=main)
    return p


def _main(a: argparse.Namespace) -> int:
    if a.prefix_test:
        return _report_prefix(a, *trio.run(run_prefix, a))
    result = trio.run(run_bench, a)
    print(format_summary(result))
    if a.out:
        atomic_write_text(a.out, json.dumps(result, indent=1) + "\n")
        print(f"wrote {a.out}")
    return 0 if result["summary"]["failed"] == 0 else 1


# A bad spec or flag, or no server at the URL: one line and exit status 2.
main = guarded(_main, httpx.HTTPError)


def _synth(name: str) -> PromptSynth:

    return PromptSynth(tokenizer(name))


def source(a: argparse.Namespace) -> tuple[Trace, str]:
    """The trace to send and how it was made."""
    if a.trace:
        given = [k for k in _LOAD_FLAGS if getattr(a, k) is not None]
        if given:
            raise ValueError(f"--{given[0]} shapes a synthetic load, not --trace")
        opts = trace_options(a)
        fmt = opts.pop("fmt") or detect_format(a.trace)
        if fmt != "nanoserve":
            window_opts = {k: opts.pop(k) for k in ("start_s", "duration_s", "speedup")}
            public = window(read_public_trace(a.trace, fmt), **window_opts)
            return (text_trace(public, _synth(a.tokenizer).tokenizer, stream=a.stream, **opts),
                    f"trace {a.trace} ({fmt})")
        if opts != {"start_s": 0.0, "duration_s": None, "speedup": 1.0, "prefixes": True,
                    "seed": 0}:
            raise ValueError("--start, --duration, --speedup, --ignore-prefixes and "
                             f"--trace-seed apply to public traces; {a.trace} is nanoserve's")
        trace = load_trace(a.trace)
        if trace.header.clock != "virtual" and a.concurrency is None:
            raise ValueError(f"{a.trace} has step-clock arrivals, which have no seconds; "
                             "give --concurrency to send it in a closed loop")
        return trace, f"trace {a.trace}"
    pairs = {**DEFAULTS, **split_load_spec(a.load or "")}
    for key in _LOAD_FLAGS:
        if getattr(a, key) is not None:
            pairs[key] = getattr(a, key)
    how = "load " + ",".join(f"{k}={v}" for k, v in pairs.items())
    if "rate" not in pairs and pairs.get("arrival", "poisson") != "trace":
        if a.concurrency is None:
            raise ValueError("an open-loop load needs a rate (--rate R), or give "
                             "--concurrency N for a closed loop")
        pairs["rate"] = "1"  # a closed loop ignores arrival times; the spec needs one
    spec = load_spec_from_pairs(pairs)
    return generate_load(spec, _synth(a.tokenizer).tokenizer), how


def bench_requests(trace: Trace, *, model: str, stream: bool,
                   extra: dict[str, Any] | None) -> list[BenchRequest]:
    return [
        BenchRequest(r.id, r.path, prepare_body(r.body, model=model, stream=stream, extra=extra),
                     at_s=r.at_s or 0.0, hangup_after_frames=r.client.hangup_after_frames)
        for r in trace.requests
    ]


def _extra(a: argparse.Namespace) -> dict[str, Any] | None:
    if not a.extra_body:
        return None
    extra = json.loads(a.extra_body)
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    return extra


async def run_bench(a: argparse.Namespace) -> dict[str, Any]:
    slo = parse_slo(a.slo) if a.slo else None
    extra = _extra(a)
    trace, how = source(a)
    url = a.url.rstrip("/")
    async with make_client(a.concurrency) as client:
        model = a.model or await served_model(client, url)
        requests = bench_requests(trace, model=model, stream=a.stream, extra=extra)
        for _ in range(a.warmup if requests else 0):
            # A server's first request pays one-off costs (lazy init, allocator growth)
            # that are no part of serving; and a body it rejects fails here, once.
            probe = await send_one(client, url, requests[0], 0.0, trio.current_time)
            if not probe.ok:
                raise ValueError(f"the warm-up request failed: {probe.error}")
        loadavg = os.getloadavg()
        started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        records, duration = await run_load(url, requests, concurrency=a.concurrency,
                                           client=client)
    summary = summarize(records, duration, slo)
    result = {
        "nanoserve_bench": RESULT_VERSION,
        "date": started,  # when the measured load began
        "label": a.label or url, "url": url, "model": model, "source": how,
        "mode": ({"closed_loop": a.concurrency} if a.concurrency is not None
                 else {"open_loop": "arrival times"}),
        "stream": a.stream, "extra_body": extra, "warmup": a.warmup,
        "loadavg_before": [round(x, 2) for x in loadavg], "summary": summary,
    }  # fmt: skip
    if a.details:
        result["requests"] = [r.to_json() for r in records]
    return result


def format_summary(result: dict[str, Any]) -> str:
    s = result["summary"]
    lines = [f"== {result['label']} ({result['model']}; {result['source']}; "
             f"{next(iter(result['mode']))}={next(iter(result['mode'].values()))})",
             f"requests {s['completed']} ok, {s['failed']} failed, {s['hung_up']} hung up in "
             f"{s['duration_s']} s",
             f"throughput {s['request_throughput']} req/s, output {s['output_throughput']} "
             f"tok/s, total {s['total_token_throughput']} tok/s"]
    if "goodput" in s:
        lines.append(f"goodput {s['goodput']} req/s ({s['good']} within {s['slo']} ms)")
    lines.append(f"{'ms':<6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for key in ("ttft", "tpot", "itl", "e2e"):
        d = s[f"{key}_ms"]
        cells = "".join(f"{d[k]:>10.1f}" for k in ("mean", "p50", "p90", "p99")) if d else \
            f"{'-':>10}" * 4
        lines.append(f"{key:<6}{cells}")
    lines.extend(f"error: {e}" for e in s.get("first_errors", []))
    return "\n".join(lines)


async def run_prefix(a: argparse.Namespace) -> tuple[PrefixResult, str, str]:
    seed = fresh_seed() if a.seed is None else int(a.seed)
    url = a.url.rstrip("/")
    synth = _synth(a.tokenizer)
    async with make_client(1) as client:
        model = a.model or await served_model(client, url)
        requests = prefix_requests(synth, seed=seed, model=model,
                                   prefix_tokens=a.prefix_tokens, n=a.prefix_n)
        res = await run_prefix_test(client, url, requests, seed=seed,
                                    prefix_tokens=a.prefix_tokens)
    return res, url, model


def _report_prefix(a: argparse.Namespace, res: PrefixResult, url: str, model: str) -> int:
    out = res.to_json()
    print(f"prefix test ({res.prefix_tokens}-token system prompt, seed {res.seed}): cold "
          f"TTFT {out['cold_ttft_ms']} ms, warm {out['warm_ttft_ms']} ms; "
          f"median warm / cold = {out['ratio']}")
    if a.out:
        atomic_write_text(a.out, json.dumps({"nanoserve_bench_prefix": RESULT_VERSION,
                                           "url": url, "model": model, **out}, indent=1))
    if out["ratio"] is None:
        errors = [r.error for r in (res.warmup, res.cold, *res.warm) if r.error]
        print(f"sim bench: a prefix-test request failed: {errors[:1]}", file=sys.stderr)
        return 1
    return 1 if a.max_ratio is not None and out["ratio"] > a.max_ratio else 0
