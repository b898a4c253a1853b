"""No request stalls another (issue 42): a body whose parsing, templating and tokenizing
take 150-500 ms runs off the event loop (server/offload.py), so eight streams keep their pace
and /health answers at once while it is processed, through a real Hypercorn socket. The
server runs in a process of its own (support/stub_server.py), so the clients' work is not
counted as its stalls.

This test alone measures time, because the property is one of time: while the heavy body is
in flight the streams keep their pace, and /health answers within 100 ms. On the event loop
(before the fix) the same body stalled everything for all of it. The clock only measures
gaps; every wait is bounded.

The streams' pace is judged where a heavy body can break it: the server's one event loop,
and the GIL its worker shares with the loop and the step thread. Either stalls every stream
at once, so the bound is on the median stream: its largest gap between frames stays under
its median gap plus 100 ms. One stream's frame late while the others' kept coming is the
host's scheduling, not a stall. On CI's slower host (the 1,000 tools took 400-540 ms of
work there, 180-260 ms here) the eight streams' worst gaps over their medians were 47-107,
59-131 and 33-113 ms in three tries, /health 37-61 ms at worst: every try missed a bound on
every stream, none the bound on the median stream (about 91, 98 and 50 ms).

Off the loop is not enough where the worker thread holds the GIL in one long C call: the
loop waits on the GIL as it would on the work. The 1 MB input caught tokenizers' `encode`
(420-470 ms in one call; nanoserve/tokenizer.py), the 10,000 tools a regular expression
over the body (53 ms; server/body/nesting.py).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

STREAMS = 8
BOUND_S = 60  # a bound on a wait that must end, never a measurement
SLACK_S = 0.100  # the bound on a stall


def tool(i: int) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": f"tool_{i}", "description": f"does thing number {i} with care",
        "parameters": {"type": "object", "required": ["a"], "properties": {
            "a": {"type": "string", "description": "the a"}, "b": {"type": "integer"}}}}}


def tools_body(n: int) -> dict[str, Any]:
    return {"model": "stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "tools": [tool(i) for i in range(n)], "tool_choice": "none"}


@dataclass(frozen=True)
class Heavy:
    """A heavy body, the server's limits it is sent under, and the answer it must get."""

    path: str
    body: dict[str, Any]
    max_tools: int
    max_chars: int | None  # None: the limits' default, 8 characters per token of context
    status: int
    param: str | None = None  # the field a 400 names
    says: str = ""  # and what its message says
    tools: bool = False  # a template that renders tools, and "auto" on

    def server(self) -> list[str]:
        chars = [] if self.max_chars is None else [str(self.max_chars)]
        chars += ["tools"] if self.tools else []
        return [sys.executable, str(Path(__file__).parents[1] / "support" / "stub_server.py"),
                str(self.max_tools), *chars]


HEAVY = {
    # The body (2.5 MB): refused by max_tools, but only once parsed to count them.
    # The refusal is about 70 ms of work, so even all of it back on the loop left the median
    # stream 72-93 ms over its median (two runs), and nesting.py's old regular expression
    # (a 65 ms hold of the GIL) failed one run of three (10 of its 12 tries, 80-202 ms): a
    # hold that short is below what this bound can see every time. (tokenizers' one-call
    # `encode`, 420-470 ms, fails the 1 MB case every try: 555-975 ms.)
    "10000-tools": Heavy("/v1/chat/completions", tools_body(10_000), 128, None, 400, "tools",
                          "tools has 10000 entries, over this server's limit of 128"),
    # 1,000 tools processed in full, the limits raised past them: checked as schemas,
    # rendered by a template that shows them to the model, and tokenized (69,889 tokens),
    # then refused for length.
    "1000-tools-served": Heavy(
        "/v1/chat/completions", {**tools_body(1_000), "tool_choice": "auto"}, 1_000,
        1_000_000, 400, "max_tokens",
        "prompt (69889 tokens) + max_tokens (1) exceeds max_model_len 4096", tools=True),
    # 1 MB of `input` (200,000 tokens), the character limits raised past it so that it is
    # templated and tokenized: the answer is the engine's 400 for length, the field spelt
    # as the Responses request spells it. With tokenizers' one-call `encode` back, /health
    # took 430-540 ms and the streams' worst gap was 430-575 ms.
    "1MB-responses-input": Heavy(
        "/v1/responses", {"model": "stub", "input": "word " * 200_000, "max_output_tokens": 1},
        128, 2_000_000, 400, "max_output_tokens",
        "prompt (200031 tokens) + max_output_tokens (1) exceeds max_model_len 4096"),
}
TRIES = 5
LONG = {"model": "stub", "prompt": "def step(self):", "max_tokens": 3_000, "stream": True,
        "ignore_eos": True}


# One torch thread for the stub's steps: on a two-core test machine torch's intra-op pool
# spins against the request's worker thread for the same cores, which slows every step
# (median gap 120 ms instead of 10) whether or not the event loop stalls.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("name", HEAVY)
async def test_a_heavy_body_stalls_no_stream_and_not_health(name: str) -> None:
    heavy = HEAVY[name]
    # Encoded once, here: encoding 2.5 MB of JSON on the client's loop while it reads the
    # streams would add the client's own pause to the gaps it measures.
    raw = json.dumps(heavy.body).encode()
    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as nursery:
            proc: trio.Process = await nursery.start(partial(
                trio.run_process, heavy.server(), stdout=subprocess.PIPE, check=False,
                env=ENV))
            try:
                assert proc.stdout is not None
                line = b""
                while not line.endswith(b"\n"):
                    chunk = await proc.stdout.receive_some()
                    assert chunk, "the server exited before it was ready"
                    line += chunk
                # The client's own collector pauses are not the server's stalls.
                gc.collect()
                gc.disable()
                try:
                    # Up to five tries on the same server: a slow or loaded 2-core host
                    # sometimes puts the median stream near the bound (CI: 91 and 98 ms in
                    # two tries of the 1,000 tools, 50 in the third), while a stalled loop
                    # (the fix reverted: 124-411 ms here) fails every try. Earlier, CI's
                    # full suite missed every try on 1,000 tools while jsonschema's
                    # pure-Python check took a second of GIL convoys
                    # (server/tools/schema_check.py).
                    for attempt in range(TRIES):
                        try:
                            await measure(line.decode().strip(), heavy, raw)
                            break
                        except AssertionError as missed:
                            if attempt + 1 == TRIES:
                                raise
                            print(f"try {attempt + 1}: {missed}")
                finally:
                    gc.enable()
            finally:
                proc.kill()


async def measure(url: str, body: Heavy, raw: bytes) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=BOUND_S) as client:
        frames: list[list[float]] = [[] for _ in range(STREAMS)]
        flowing, heavy_done = trio.Event(), trio.Event()
        health_s: list[float] = []
        heavy: list[httpx.Response] = []

        async def stream(i: int) -> None:
            async with client.stream("POST", "/v1/completions", json=LONG) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if not line:
                        continue
                    frames[i].append(trio.current_time())
                    if all(len(f) >= 5 for f in frames):
                        flowing.set()
                    if heavy_done.is_set():
                        return  # this frame's gap spans the heavy request's processing
            raise AssertionError("a stream ended before the heavy request did")

        async def send_heavy() -> None:
            heavy.append(await client.post(body.path, content=raw, headers={
                "Content-Type": "application/json"}))
            heavy_done.set()

        async def probe_health() -> None:
            while not heavy_done.is_set():
                t0 = trio.current_time()
                r = await client.get("/health")
                health_s.append(trio.current_time() - t0)
                assert r.status_code == 200
                await trio.sleep(0.005)

        async with trio.open_nursery() as nursery:
            for i in range(STREAMS):
                nursery.start_soon(stream, i)
            await flowing.wait()
            t0 = trio.current_time()
            nursery.start_soon(send_heavy)
            nursery.start_soon(probe_health)
            await heavy_done.wait()
            heavy_s = trio.current_time() - t0

    assert heavy[0].status_code == body.status, heavy[0].text
    if body.status != 200:
        error = heavy[0].json()["error"]
        assert error["param"] == body.param, error
        assert body.says in error["message"], error
    report = [f"heavy request {heavy_s * 1e3:.0f} ms",
              f"/health worst {max(health_s) * 1e3:.1f} ms of {len(health_s)}"]
    over = []
    for f in frames:
        gaps = [b - a for a, b in zip(f[1:], f[2:], strict=False)]  # after the first frame
        median, worst = statistics.median(gaps), max(gaps)
        report.append(f"gap median {median * 1e3:.1f} ms, worst {worst * 1e3:.1f} ms")
        over.append(worst - median)
    typical = statistics.median(over)
    report.append(f"the median stream's worst gap over its median: {typical * 1e3:.1f} ms")
    print("\n".join(report))
    assert typical < SLACK_S, "\n".join(report)
    assert max(health_s) < SLACK_S, "\n".join(report)
    assert len(health_s) >= 3, "too few probes while the body was in flight"
