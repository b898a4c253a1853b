"""`sim replay --target` at nanoserve itself, through `nanoserve serve --model stub` on a real
socket: the built-in scenarios and three committed traces, every check passing, and the
report written as JSON and as the table the terminal shows.

On real weights the same command is run by hand (docs/replay.md has its table): here the
stub keeps it to seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.serve_process import serving
from support.server_harness import make_engine

from nanoserve.bridge.clock import LiveClock
from nanoserve.server import ServerConfig, create_app
from sim import commands as cli
from sim.http.loopback import hypercorn_on_loopback
from sim.target import checks, load, pacing, target_command, wire
from sim.target.outcome import Outcome, Report
from sim.target.target import Target

ROOT = Path(__file__).resolve().parents[3]
TRACES = [str(ROOT / "traces" / name) for name in ("hangups.jsonl", "unicode.jsonl",
                                                   "stop_strings.jsonl")]


def test_nanoserve_passes_every_check(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    with serving(["--model", "stub"]) as url:
        code = cli.main(["replay", "--target", url, "--scenarios", *TRACES,
                         "--report", str(report), "--settle", "5", "--slow-window", "3"])
    got = json.loads(report.read_text())
    assert [(c["check"], c["status"]) for c in got["checks"]] == [
        ("stream = unary", "pass"), ("utf-8 frames", "pass"), ("stop strings", "pass"),
        ("usage", "pass"), ("hang-up frees its slot", "pass"),
        ("slow readers don't pace", "pass"), ("bad input", "pass"),
        ("trace: no server errors (hangups.jsonl)", "pass"),
        ("trace: frames (hangups.jsonl)", "pass"),
        ("trace: stream = unary (hangups.jsonl)", "pass"),
        ("trace: hang-ups free their slots (hangups.jsonl)", "pass"),
        ("trace: no server errors (unicode.jsonl)", "pass"),
        ("trace: frames (unicode.jsonl)", "pass"),
        ("trace: stream = unary (unicode.jsonl)", "pass"),
        ("trace: no server errors (stop_strings.jsonl)", "pass"),
        ("trace: frames (stop_strings.jsonl)", "pass"),
        ("trace: stream = unary (stop_strings.jsonl)", "pass")]
    assert code == 0
    assert got["identity"] == {"model": "stub", "server": "hypercorn-h11"}
    table = (tmp_path / "report.json.txt").read_text()
    assert table.startswith(f"target {url} (model stub, server hypercorn-h11)")


def test_a_failing_check_exits_1_and_a_missing_target_2(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    async def one_fail(url: str, *_: object, **__: object) -> Report:
        return Report(url, {"model": "m"}, [Outcome("usage", "fail", "1 disagreement",
                                                    ({"why": "off by one"},))])

    with monkeypatch.context() as m:
        m.setattr(target_command, "run", one_fail)
        assert cli.main(["replay", "--target", "http://x", "--scenarios"]) == 1
    out = capsys.readouterr().out
    assert "usage  fail         1 disagreement" in out
    assert '"why": "off by one"' in out
    assert cli.main(["replay", "--target", "http://127.0.0.1:9", "--scenarios"]) == 2
    assert cli.main(["replay", "--target", "http://127.0.0.1:9"]) == 2  # nothing to run
    assert cli.main(["replay", "--scenarios", TRACES[0]]) == 2  # --scenarios needs --target


async def test_a_server_with_a_key_is_checked_with_it() -> None:
    # Every request carries the key, the slow readers' raw sockets too: without it they
    # would get 401s, and the slow-reader check would be unsupported, not passed.
    app = create_app(make_engine(max_model_len=4096, num_blocks=2048),
                     ServerConfig("stub", api_key="sk-test"), clock=LiveClock())
    async with hypercorn_on_loopback(app) as url, wire.make_client("sk-test") as cl:
        t = Target(url, cl, "stub", settle_s=5.0, window_s=1.0, api_key="sk-test")
        got = [await pacing.slow_readers(t), await load.hangup_frees_slot(t),
               await checks.bad_input(t)]
    assert [o.status for o in got] == ["pass", "pass", "pass"], got
