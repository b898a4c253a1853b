"""`nanoserve serve --tensor-parallel-size 3` as a real process, and a rank killed mid-stream.

The engine-death path is the single-process one (tests/server/test_faults*): the stream
ends with an error frame and [DONE], /health turns 503, SIGTERM still exits 0; and no rank
process outlives the server (checked by PID). `trio.fail_after` bounds a hang; nothing here
measures time.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from functools import partial
from typing import Any

import httpx
import trio
from server_harness import keep_reading, read_until_ready

SERVE = [sys.executable, "-m", "nanoserve.cli", "serve", "--model", "smollm2", "--port", "0",
         "--tensor-parallel-size", "3", "--num-blocks", "256", "--max-model-len", "2048",
         "--shutdown-grace", "0.5"]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except FileNotFoundError:
        return False


async def test_a_rank_killed_mid_stream_fails_the_engine_and_leaves_no_orphan() -> None:
    log: list[str] = []
    with trio.fail_after(240):
        async with trio.open_nursery() as nursery:
            proc: Any = await nursery.start(partial(
                trio.run_process, SERVE, stderr=subprocess.PIPE, check=False))
            url = await read_until_ready(proc.stderr, log)
            nursery.start_soon(keep_reading, proc.stderr, log)
            found = [re.search(r"rank pids ([\d ]+)", line) for line in log]
            pids = [int(p) for m in found if m for p in m.group(1).split()]
            assert len(pids) == 2, "\n".join(log)
            assert all(_alive(p) for p in pids)
            body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 1500,
                    "ignore_eos": True, "stream": True}
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                assert (await client.get("/health")).status_code == 200
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    assert resp.status_code == 200
                    lines = resp.aiter_lines()
                    first = await anext(lines)
                    assert first.startswith("data: {")  # tokens are flowing
                    os.kill(pids[1], signal.SIGKILL)  # rank 2
                    events = [line[len("data: "):] async for line in lines
                              if line.startswith("data: ")]
                assert events[-1] == "[DONE]"
                err = json.loads(events[-2])["error"]
                assert "rank 2" in err["message"], err
                assert (await client.get("/health")).status_code == 503
            proc.send_signal(signal.SIGTERM)
        assert proc.returncode == 0, "\n".join(log)
    assert not any(_alive(p) for p in pids), "\n".join(log)


def test_serve_refuses_a_size_the_heads_do_not_divide() -> None:
    out = subprocess.run([*SERVE[:-8], "--tensor-parallel-size", "2"], capture_output=True,
                         text=True, check=False)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        "nanoserve serve: error: --tensor-parallel-size 2 does not divide 9 attention heads; "
        "3 KV heads (N must divide them or be a multiple of them); this model shards at 1, 3")
