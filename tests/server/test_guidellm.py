"""GuideLLM, vLLM's benchmark tool, against the stub server over a real socket.

GuideLLM runs as its own process from .venv/guidellm (`just guidellm-setup`, which `just test`
runs first) and speaks the OpenAI chat API with streaming and vLLM's `stream_options`
(`continuous_usage_stats` included). A 16-request benchmark at 4 streams must end with 16
successes, 0 errors, 16 output tokens each by its own count, and every KV block free.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import trio
from support.http_harness import hypercorn_on_loopback
from support.server_harness import make_engine

from nanoserve.bridge.clock import LiveClock
from nanoserve.model.loader import resolve_model
from nanoserve.server import ServerConfig, counter_ids, create_app, server_state
from sim.bench.guidellm import GUIDELLM, guidellm_command, offline_env, summarize

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    not (ROOT / GUIDELLM).exists(),
    reason=f"GuideLLM is not installed at {GUIDELLM} (run `just guidellm-setup`)")


async def test_guidellm_benchmark_against_the_stub(tmp_path: Path) -> None:
    engine = make_engine(num_blocks=512, max_num_seqs=16)
    app = create_app(engine, ServerConfig("stub"), clock=LiveClock(), id_source=counter_ids(),
                     time_source=lambda: 1_700_000_000.0)
    report = tmp_path / "guidellm.json"
    async with hypercorn_on_loopback(app) as url:
        cmd = guidellm_command(url, "stub", resolve_model("smollm2"), streams=4, requests=16,
                               prompt_tokens=64, output_tokens=16, out_json=report)
        with trio.fail_after(600):  # a bound on a hang, not a timing assertion
            done = await trio.run_process(
                [str(ROOT / cmd[0]), *cmd[1:]], cwd=tmp_path, env=offline_env(), check=False,
                capture_stdout=True, capture_stderr=True)
        assert done.returncode == 0, done.stdout.decode()[-3000:] + done.stderr.decode()[-3000:]
        ready = server_state(app).ready
        assert ready is not None
        await ready.bridge.wait_idle()
    figures = summarize(json.loads(report.read_text()))
    assert (figures["successful"], figures["errored"], figures["incomplete"]) == (16, 0, 0)
    (bench,) = json.loads(report.read_text())["benchmarks"]
    outputs = [r["output_metrics"]["text_tokens"] for r in bench["requests"]["successful"]]
    assert outputs == [16] * 16  # counted from our usage, chunk by chunk
    s = engine.statistics()
    assert (s.finished, s.aborted, s.free_blocks) == (16, 0, s.num_blocks)


def test_guidellm_runs_offline() -> None:
    """The interpreter imports GuideLLM with the hub switched off (no network in CI)."""
    out = subprocess.run([str(ROOT / GUIDELLM), "--version"], env=offline_env(),
                         capture_output=True, text=True, check=False, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "0.8.1" in out.stdout


