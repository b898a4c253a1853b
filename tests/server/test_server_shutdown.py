"""`nanoserve serve` as a real process: SIGTERM with streams in flight.

The server gets a short grace period and four streams far too long to finish in it, so each
must be ended by the server itself: an error frame naming the shutdown, then [DONE], and the
process exits 0. The in-process drain test (test_server_disconnect.py) covers the other half,
requests that do finish within the grace. `trio.fail_after` bounds the test; nothing here
measures time.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from contextlib import AsyncExitStack
from functools import partial
from typing import Any

import httpx
import pytest
import trio
from support.server_harness import keep_reading, read_until_ready

SERVE = [sys.executable, "-m", "nanoserve.cli", "serve", "--model", "stub", "--port", "0",
         "--max-model-len", "4096", "--num-blocks", "1024", "--shutdown-grace", "0.5"]


async def test_sigterm_ends_streams_with_done_and_exits_zero() -> None:
    log: list[str] = []
    with trio.fail_after(120):  # a bound on a hang, not a timing assertion
        async with trio.open_nursery() as nursery:
            proc: Any = await nursery.start(partial(
                trio.run_process, SERVE, stderr=subprocess.PIPE, check=False))
            url = await read_until_ready(proc.stderr, log)
            nursery.start_soon(keep_reading, proc.stderr, log)
            body = {"model": "stub", "prompt": "def step(self):", "max_tokens": 3000,
                    "ignore_eos": True, "stream": True}
            async with httpx.AsyncClient(base_url=url, timeout=60) as client, \
                    AsyncExitStack() as stack:
                streams = []
                for _ in range(4):
                    resp = await stack.enter_async_context(
                        client.stream("POST", "/v1/completions", json=body))
                    assert resp.status_code == 200
                    lines = resp.aiter_lines()
                    first = await anext(lines)  # the stream is under way
                    assert first.startswith("data: {")
                    streams.append(lines)
                proc.send_signal(signal.SIGTERM)
                for lines in streams:
                    events = [line[len("data: "):] async for line in lines
                              if line.startswith("data: ")]
                    assert events[-1] == "[DONE]"
                    err = json.loads(events[-2])
                    assert err["error"]["code"] == "shutting_down", events[-2]
        assert proc.returncode == 0, "\n".join(log)
    assert not any("Traceback" in line for line in log), "\n".join(log)
    assert any("ending 4 request(s)" in line for line in log), "\n".join(log)


def test_serve_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    from nanoserve import flags
    from nanoserve.server import main

    assert flags.size_bytes("2GiB") == 2 << 30
    assert flags.size_bytes("1.5 GB") == 1_500_000_000
    assert flags.size_bytes("4096") == 4096
    with pytest.raises(argparse.ArgumentTypeError):
        flags.size_bytes("2 gallons")
    p = argparse.ArgumentParser()
    main.add_args(p)
    monkeypatch.setenv("NANOSERVE_API_KEY", "from-env")
    a = p.parse_args(["--kv-cache-memory", "512MiB", "--max-num-seqs", "8", "--max-queue", "3",
                      "--served-model-name", "tiny", "--chat-template", "{{ messages }}"])
    cfg, server = main.engine_config(a), main.server_config(a)
    assert (cfg.kv_cache_memory, cfg.num_blocks, cfg.max_num_seqs) == (512 << 20, None, 8)
    assert server.api_key == "from-env"
    assert (server.served_model_name, server.max_queue) == ("tiny", 3)
    assert server.chat_template == "{{ messages }}"
    assert "from-env" not in repr(server)
    assert main.server_config(p.parse_args(["--api-key", "flag"])).api_key == "flag"
    with pytest.raises(SystemExit):  # one way to size the pool, not two
        p.parse_args(["--num-blocks", "8", "--kv-cache-memory", "1GiB"])
