"""`serve --record` never loses good requests: bodies strict JSON cannot hold are recorded as
their bytes, the file is written as the server runs (sim/trace/journal.py), and a recording
that could not write something says so and exits 1.

The stub cases run in-process on a real loopback socket (tests/sim/record/test_record.py's harness);
the must-show runs `nanoserve serve --record` as a process, 200 requests with 10 poisoned
bodies among them, stopped halfway by SIGKILL and by SIGTERM: every request that had its
answer before the stop is in the file, and `sim replay` replays the file clean.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from support.server_harness import keep_reading, make_engine, read_until_ready
from test_record import Raw, recorded, replay_in_thread

from nanoserve.bridge.clock import LiveClock
from sim.trace.journal import INCOMPLETE
from sim.trace.loader import TraceError, load_trace
from sim.trace.write import dumps_trace

GOOD = {"model": "stub", "prompt": "def step(self):", "max_tokens": 4}
# Bodies that are rightly refused (400) and that strict JSON cannot hold as an object.
POISON = [
    b'{"model": "stub", "prompt": "\\ud800", "max_tokens": 4}',  # a lone surrogate
    b'{"model": "stub", "prompt": "x", "max_tokens": 4, "extra": NaN}',
    b'{"model": "stub", "prompt": "x", "max_tokens": 4, "extra": Infinity}',
    b'{"model": "stub", "prompt": "x", "temperature": -Infinity}',
    b'[{"model": "stub", "prompt": "x"}]',  # JSON, but not an object
]


async def post_bytes(addr: str, raw: bytes, path: str = "/v1/completions") -> Raw:
    host, port = addr.rsplit(":", 1)
    sock = await trio.open_tcp_stream(host, int(port))
    await sock.send_all(
        f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Connection: close\r\nContent-Length: {len(raw)}\r\n\r\n".encode() + raw)
    return Raw(sock)


async def test_poisoned_bodies_are_recorded_as_bytes_and_replay_clean(tmp_path: Path) -> None:
    """Before: close() raised on the first of these (UnicodeEncodeError, ValueError) and the
    whole recording was lost, good requests included."""
    path = tmp_path / "poisoned.jsonl"
    async with recorded(make_engine(), LiveClock(), path) as (addr, _, rec):
        first = await Raw.post(addr, {**GOOD, "seed": 1})
        await first.read_all()
        for raw in POISON:
            bad = await post_bytes(addr, raw)
            assert (await bad.read_all()).startswith(b"HTTP/1.1 400"), raw
        last = await Raw.post(addr, {**GOOD, "prompt": "The quick"})
        await last.read_all()
    assert not rec.failed
    text = path.read_text(encoding="utf-8")
    assert INCOMPLETE not in text.splitlines()[0]  # closed: the canonical trace
    trace = load_trace(path)
    # Refusals never reach the bridge: they follow the requests it took at their boundary.
    assert [r.raw_body for r in trace.requests] == [None, None, *POISON]
    statuses = {e.id: e.fields.get("status") for e in trace.expectations}
    assert [statuses[r.id] for r in trace.requests] == [200, 200, 400, 400, 400, 400, 400]
    assert [e.id for e in trace.expectations][-1] == "end"
    result = await replay_in_thread(path)
    assert result.mismatches == ()
    assert dumps_trace(load_trace(path)) == text  # the writer's own round trip


async def test_the_file_is_a_replayable_trace_while_the_server_runs(tmp_path: Path) -> None:
    path, snapshot = tmp_path / "live.jsonl", tmp_path / "snapshot.jsonl"
    async with recorded(make_engine(), LiveClock(), path) as (addr, _, _):
        for i in range(3):
            r = await Raw.post(addr, {**GOOD, "max_tokens": 3 + i})
            await r.read_all()
        bad = await post_bytes(addr, POISON[1])
        await bad.read_all()
        await trio.testing.wait_all_tasks_blocked()  # the server's side has ended too
        snapshot.write_bytes(path.read_bytes())  # what a kill now would leave
    head = json.loads(snapshot.read_text().splitlines()[0])
    assert INCOMPLETE in head
    trace = load_trace(snapshot)
    assert trace.header.note is not None
    assert "recovered" in trace.header.note
    assert [(r.at_step, r.raw_body) for r in trace.requests][-1][1] == POISON[1]
    assert [e.fields["status"] for e in trace.expectations] == [200, 200, 200, 400]
    assert all(e.id != "end" for e in trace.expectations)
    final = load_trace(path)
    # The snapshot's outcomes are the final trace's, line for line (ids aside).
    assert [e.fields for e in trace.expectations] == [e.fields for e in final.expectations[:-1]]
    result = await replay_in_thread(snapshot)
    assert result.mismatches == ()


def test_a_line_cut_short_by_a_kill_is_dropped_and_one_in_the_middle_is_an_error(
    tmp_path: Path,
) -> None:
    head = {"nanoserve_trace": 1, "clock": "step", "model": "stub", INCOMPLETE: "yes",
            "engine": {"block_size": 16, "num_blocks": 8, "max_num_seqs": 4,
                       "max_num_batched_tokens": 64, "seed": 0}}
    req = {"id": "r2", "at_step": 3, "path": "/v1/completions", "body": {"prompt": "a"},
           "client": {"read": "eager"}, "order": [3, 0, 1]}
    early = {**req, "id": "r1", "at_step": 0, "order": [0, 0, 0]}
    lines = [json.dumps(head), json.dumps(req), json.dumps(early),
             json.dumps({"amend": "r1", "client": {"read": "eager", "hangup_at_step": 2}}),
             json.dumps({"expect": "r1", "status": 200}), '{"expect": "r2", "sta']
    path = tmp_path / "torn.jsonl"
    path.write_text("\n".join(lines))
    trace = load_trace(path)
    assert [(r.id, r.client.hangup_at_step) for r in trace.requests] == [("r1", 2),
                                                                         ("r2", None)]
    assert [e.id for e in trace.expectations] == ["r1"]
    assert trace.header.note is not None
    assert "cut short" in trace.header.note
    assert INCOMPLETE not in trace.header.extra
    path.write_text("\n".join([*lines[:2], "{not json", *lines[2:5]]))
    with pytest.raises(TraceError, match="line 3"):
        load_trace(path)


async def test_a_request_that_cannot_be_written_is_named_and_fails_the_recording(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    from sim.trace.journal import JournalWriter

    original = JournalWriter.write

    def write(self: JournalWriter, line: str) -> None:
        if "refuse me" in line:
            raise OSError(28, "No space left on device")
        original(self, line)

    monkeypatch.setattr(JournalWriter, "write", write)
    path = tmp_path / "full.jsonl"
    async with recorded(make_engine(), LiveClock(), path) as (addr, _, rec):
        a = await Raw.post(addr, {**GOOD, "prompt": "refuse me"})
        await a.read_all()
        b = await Raw.post(addr, GOOD)
        await b.read_all()
    assert rec.failed
    lost = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(lost) == 1
    assert "could not record r1 (/v1/completions, request ids " in lost[0]
    # The close still wrote the whole trace, the request the journal missed included.
    assert len(load_trace(path).requests) == 2


def test_serve_exits_1_when_the_recording_failed() -> None:
    from nanoserve.server.main import exit_code

    class Rec:
        failed = True

    assert exit_code(0, Rec(), "f.jsonl") == 1
    assert exit_code(0, None, "f.jsonl") == 0
    Rec.failed = False
    assert exit_code(0, Rec(), "f.jsonl") == 0


# ------------------------------------------------------------- the must-show

SERVE = [sys.executable, "-m", "nanoserve.cli", "serve", "--model", "stub", "--port", "0",
         "--max-model-len", "1024", "--num-blocks", "512", "--shutdown-grace", "0.5"]
N, STOP_AFTER, WORKERS = 200, 100, 8


def body_of(k: int) -> bytes:
    """Request k: every 20th from the 7th on is poisoned (10 of 200); the rest are unseeded,
    so their tokens depend on their admission numbers, which a missing line would shift."""
    if k % 20 == 7:
        return POISON[(k // 20) % len(POISON)]
    return json.dumps({"model": "stub", "prompt": f"request {k}: def step(self):",
                       "max_tokens": 6 + k % 7, "stream": k % 2 == 0}).encode()


@pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGTERM], ids=["kill", "term"])
async def test_200_requests_with_10_poisoned_stopped_halfway_replay_clean(
    tmp_path: Path, stop: signal.Signals
) -> None:
    path = tmp_path / "run.jsonl"
    answered: dict[int, int] = {}  # k -> status, for every response read whole before the stop
    log: list[str] = []
    with trio.fail_after(180):  # a bound on a hang, not a timing assertion
        async with trio.open_nursery() as nursery:
            proc: Any = await nursery.start(partial(
                trio.run_process, [*SERVE, "--record", str(path)], stderr=subprocess.PIPE,
                check=False))
            url = await read_until_ready(proc.stderr, log)
            nursery.start_soon(keep_reading, proc.stderr, log)
            stopped = trio.Event()
            todo = iter(range(N))

            async def worker(client: httpx.AsyncClient) -> None:
                for k in todo:
                    if stopped.is_set():
                        return
                    try:
                        r = await client.post("/v1/completions", content=body_of(k),
                                              headers={"content-type": "application/json"})
                    except httpx.HTTPError:
                        return  # the server is gone
                    if stopped.is_set():
                        return  # read after the stop: not counted
                    answered[k] = r.status_code
                    if len(answered) == STOP_AFTER:
                        proc.send_signal(stop)
                        stopped.set()

            async with httpx.AsyncClient(base_url=url, timeout=60) as client, \
                    trio.open_nursery() as clients:
                for _ in range(WORKERS):
                    clients.start_soon(worker, client)
            await proc.wait()
    assert proc.returncode == (-signal.SIGKILL if stop == signal.SIGKILL else 0), log
    poisoned = {k for k in answered if k % 20 == 7}
    assert poisoned
    assert all(answered[k] == 400 for k in poisoned)
    assert all(answered[k] == 200 for k in answered.keys() - poisoned)
    head = json.loads(path.read_text().splitlines()[0])
    assert (INCOMPLETE in head) == (stop == signal.SIGKILL)
    trace = load_trace(path)
    recorded_bodies = [r.raw_body if r.raw_body is not None else json.dumps(r.body).encode()
                       for r in trace.requests]
    missing = [k for k in answered if body_of(k) not in recorded_bodies]
    assert missing == [], f"answered before the stop, not in the file: {missing}"
    by_id = {e.id: e.fields for e in trace.expectations}
    outcomes = [by_id[r.id]["status"] for r in trace.requests if r.id in by_id]
    assert outcomes.count(400) >= len(poisoned)
    result = await replay_in_thread(path)
    assert result.mismatches == ()
    assert result.expectations_checked
    print(f"{stop.name}: {len(answered)} answered ({len(poisoned)} poisoned) before the stop; "
          f"the file holds {len(trace.requests)} requests, {len(outcomes)} with an outcome; "
          f"replay: {result.summary()}")
