"""What `sim record --upstream` adds to each frame: the latency from an upstream's send to the
client's read, straight and through the proxy, in the same run.

An upstream in a process of its own streams frames that carry the moment it sent them
(CLOCK_MONOTONIC, which every process on the machine shares), one every `--every-ms`. The
client reads them straight from the upstream, then through the proxy (`sim record`, a
process of its own as a user runs it), taking turns `--rounds` times, and prints the p50
and p90 of each and what the proxy adds.

    .venv/bin/python scripts/bench_proxy.py [--frames 200] [--every-ms 5] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

ROOT = Path(__file__).resolve().parents[1]


async def upstream(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Streams `frames` frames, each with the time it was sent, `every_ms` apart."""
    from sim.http import raw_asgi

    if scope["type"] == "lifespan":
        await raw_asgi.lifespan(receive, send)
        return
    if scope["path"] == "/v1/models":
        await raw_asgi.respond_json(send, 200, {"data": [{"id": "clock"}]})
        return
    req = json.loads((await raw_asgi.read_body(receive))[0])
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})
    for _ in range(req["max_tokens"]):
        await trio.sleep(req["every_ms"] / 1e3)
        frame = {"choices": [{"index": 0, "text": "x", "finish_reason": None}],
                 "sent_ns": time.monotonic_ns()}
        await send({"type": "http.response.body", "more_body": True,
                    "body": b"data: " + json.dumps(frame).encode() + b"\n\n"})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


async def serve_upstream() -> None:
    from sim.http.loopback import hypercorn_on_loopback

    async with hypercorn_on_loopback(upstream) as url:
        print(url, flush=True)
        await trio.sleep_forever()


async def latencies(url: str, frames: int, every_ms: float) -> list[float]:
    """Milliseconds from each frame's send to its read."""
    out: list[float] = []
    body = {"model": "clock", "prompt": "", "max_tokens": frames, "every_ms": every_ms,
            "stream": True}
    async with httpx.AsyncClient(timeout=60) as client, \
            client.stream("POST", url + "/v1/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                sent = json.loads(line[6:])["sent_ns"]
                out.append((time.monotonic_ns() - sent) / 1e6)
    return out


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(p / 100 * (len(s) - 1) + 0.5))]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--frames", type=int, default=200)
    p.add_argument("--every-ms", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--serve-upstream", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.serve_upstream:
        trio.run(serve_upstream)
        return 0
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    up = subprocess.Popen([sys.executable, __file__, "--serve-upstream"], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert up.stdout is not None
    up_url = up.stdout.readline().strip()
    out = Path(tempfile.mkdtemp()) / "proxied.jsonl"
    proxy = subprocess.Popen([sys.executable, "-m", "sim.commands", "record", "--upstream", up_url,
                              "--out", str(out), "--port", "8139"], env=env,
                             stderr=subprocess.PIPE, text=True)
    assert proxy.stderr is not None
    while "listening on" not in proxy.stderr.readline():
        pass
    try:
        direct: list[float] = []
        via: list[float] = []
        for _ in range(a.rounds):
            direct += trio.run(latencies, up_url, a.frames, a.every_ms)
            via += trio.run(latencies, "http://127.0.0.1:8139", a.frames, a.every_ms)
    finally:
        proxy.terminate()
        up.terminate()
        proxy.wait(30)
        up.wait(30)
    print(f"{len(direct)} frames each way, one every {a.every_ms} ms")
    for name, xs in (("straight", direct), ("through the proxy", via)):
        print(f"{name:>18}: p50 {pct(xs, 50):.3f} ms, p90 {pct(xs, 90):.3f} ms")
    print(f"{'the proxy adds':>18}: p50 {pct(via, 50) - pct(direct, 50):.3f} ms, "
          f"p90 {pct(via, 90) - pct(direct, 90):.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
