"""A fleet: `python -m nanoserve.live_fleet 2 --model stub` (two `nanoserve serve` replicas behind
sglang-router 0.3.2, from .venv/router: `just router-setup`, which `just test` runs first) as
real processes on real sockets.

- 200 mixed requests through the router (completions and chat, streamed and not, some with
  n=2, 16 at a time, the official `openai` client) all succeed, complete, and reach both
  replicas: each replica's request counter in /metrics, summed, is exactly 200.
- SIGKILL one replica under load. nanoserve/live_fleet.py keeps the router's retries, spread over
  longer than its health checks take to drop a dead replica, so a unary request on the dead
  replica is re-run on the other and only a stream already under way can fail: every
  failure is such a stream, there are at most as many as the router had on that replica
  when it died (its `/workers` load, plus what was sent between that read and the kill),
  every request sent after the kill succeeds, and the other replica serves them all.
- Every test ends with SIGTERM to the launcher: it exits 0, and by then the router and every
  replica are gone. SIGKILL to the launcher: they go too (each was told to take SIGTERM when
  it dies).

`trio.fail_after` bounds each test against a hang; nothing here measures time.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from nanoserve.live_fleet import ROUTER_PYTHON

pytestmark = pytest.mark.skipif(
    not ROUTER_PYTHON.exists(),
    reason=f"sglang-router is not installed at {ROUTER_PYTHON} (run `just router-setup`)")


@dataclass(slots=True)
class Fleet:
    url: str
    replicas: list[tuple[str, int]]  # (url, pid)
    router_pid: int
    proc: Any  # trio.Process of the launcher
    logs: Path

    def pids(self) -> list[int]:
        return [pid for _, pid in self.replicas] + [self.router_pid]

    def tails(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                         for p in sorted(self.logs.iterdir()))


def alive(pid: int) -> bool:
    """Running (a zombie, exited but not yet reaped by whoever adopted it, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


@asynccontextmanager
async def fleet(tmp_path: Path, *flags: str, n: int = 2) -> AsyncIterator[Fleet]:
    """The launcher, up; on leaving, SIGTERM to it, which must exit 0 having ended every
    child (checked the moment it has exited: it waits for them itself)."""
    logs = tmp_path / "logs"
    cmd = [sys.executable, "-m", "nanoserve.live_fleet", str(n), "--model", "stub", "--log-dir",
           str(logs), *flags]
    async with trio.open_nursery() as nursery:
        with (tmp_path / "fleet.err").open("wb") as err:
            proc: Any = await nursery.start(partial(
                trio.run_process, cmd, stdout=subprocess.PIPE, stderr=err, check=False))
        buf = b""
        while b"\n" not in buf:
            chunk = await proc.stdout.receive_some()
            assert chunk, "the fleet exited before it was up:\n" + (
                tmp_path / "fleet.err").read_text()
            buf += chunk
        line = buf.decode().splitlines()[0]
        m = re.fullmatch(rf"fleet: (http://\S+) \({n} replicas?: (.*); router pid (\d+), "
                         r"policy \w+\)", line)
        assert m, line
        reps = [(u, int(p)) for u, p in re.findall(r"(http://\S+) pid (\d+)", m.group(2))]
        fl = Fleet(m.group(1), reps, int(m.group(3)), proc, logs)
        try:
            yield fl
        finally:
            stopped_here = proc.returncode is None
            if stopped_here:
                proc.send_signal(signal.SIGTERM)
            await proc.wait()
    assert [p for p in fl.pids() if alive(p)] == [], fl.tails()
    if stopped_here:
        assert proc.returncode == 0, (tmp_path / "fleet.err").read_text()


async def requests_served(url: str) -> int:
    """The replica's finished requests (one per request, whatever its n)."""
    async with httpx.AsyncClient(timeout=10) as c:
        text = (await c.get(f"{url}/metrics")).text
    m = re.search(r"^nanoserve:e2e_request_latency_seconds_count\{[^}]*\} (\S+)$", text, re.M)
    assert m, text[:500]
    return int(float(m.group(1)))


async def test_mixed_load_through_the_router_reaches_both_replicas(tmp_path: Path) -> None:
    with trio.fail_after(120):  # a bound on a hang, not a timing assertion
        async with fleet(tmp_path, "--policy", "round_robin") as fl, \
                AsyncExitStack() as stack:
            client = await stack.enter_async_context(openai.AsyncOpenAI(
                base_url=f"{fl.url}/v1", api_key="unused", max_retries=0, timeout=60))
            models = await client.models.list()
            assert [m.id for m in models.data] == ["stub"]  # the name from /server_info
            failures: list[str] = []
            limiter = trio.CapacityLimiter(16)

            async def one(i: int) -> None:
                async with limiter:
                    try:
                        await mixed_request(client, i)
                    except Exception as exc:  # each failure is reported, none is fatal
                        failures.append(f"request {i}: {exc!r}")

            async with trio.open_nursery() as nursery:
                for i in range(200):
                    nursery.start_soon(one, i)
            assert failures == [], failures[:5]
            served = [await requests_served(u) for u, _ in fl.replicas]
            assert sum(served) == 200, served  # nothing lost, nothing run twice
            assert min(served) > 0, served
            print(f"200 requests through the router, 0 failures, per replica {served}")


async def mixed_request(client: openai.AsyncOpenAI, i: int) -> None:
    """Request i of the mix: completion or chat, streamed or not, n=2 every fifth; raises
    unless every choice arrives whole (a finish reason for each)."""
    n = 2 if i % 5 == 0 else 1
    chat, stream = i % 4 in (2, 3), i % 2 == 1
    args: dict[str, Any] = {"model": "stub", "max_tokens": 4 + i % 9, "n": n,
                            "temperature": 0.0 if i % 3 else 1.0, "seed": i}
    if chat:
        args["messages"] = [{"role": "user", "content": f"question {i}: how are blocks paged?"}]
        call: Any = client.chat.completions.create
    else:
        args["prompt"] = f"prompt {i}: The quick brown fox"
        call = client.completions.create
    finished: dict[int, str | None] = {}
    if stream:
        async for chunk in await call(stream=True, **args):
            for c in chunk.choices:
                if c.finish_reason is not None:
                    finished[c.index] = c.finish_reason
    else:
        resp = await call(**args)
        finished = {c.index: c.finish_reason for c in resp.choices}
    if sorted(finished) != list(range(n)) or not set(finished.values()) <= {"length", "stop"}:
        raise AssertionError(f"incomplete: {finished}")


@dataclass(slots=True)
class Outcome:
    i: int
    stream: bool
    sent: float  # trio.current_time() when the request was sent
    error: str | None


async def test_a_killed_replica_fails_only_its_streams(tmp_path: Path) -> None:
    with trio.fail_after(180):
        async with fleet(tmp_path) as fl, httpx.AsyncClient(base_url=fl.url, timeout=60) as c:
            outcomes: list[Outcome] = []
            done_before_kill = trio.Event()
            limiter = trio.CapacityLimiter(16)
            total = 128

            async def one(i: int) -> None:
                async with limiter:
                    o = Outcome(i, i % 2 == 0, trio.current_time(), None)
                    try:
                        await raw_request(c, i, o.stream)
                    except (httpx.HTTPError, AssertionError) as exc:
                        o.error = repr(exc)
                    outcomes.append(o)
                    if len(outcomes) == 32:
                        done_before_kill.set()

            async with trio.open_nursery() as nursery:
                for i in range(total):
                    nursery.start_soon(one, i)
                await done_before_kill.wait()
                served_before = {u: await requests_served(u) for u, _ in fl.replicas}
                # What the router has on each replica (its load counts a request from the
                # choice of worker until the response body is done); the victim is the
                # busier one (cache_aware may well send a run of similar prompts to one).
                read_at = trio.current_time()
                loads = {w["url"]: w["load"] for w in (await c.get("/workers")).json()["workers"]}
                (victim_url, victim), (other_url, _) = sorted(
                    fl.replicas, key=lambda r: -loads[r[0]])
                os.kill(victim, signal.SIGKILL)
                killed_at = trio.current_time()
                load, other_before = loads[victim_url], served_before[other_url]

            sent_in_window = sum(read_at <= o.sent <= killed_at for o in outcomes)
            failed = [o for o in outcomes if o.error]
            after = [o for o in outcomes if o.sent > killed_at]
            other_served = await requests_served(other_url) - other_before
            report = (f"{total} requests, the victim's load at the kill {load} (+{sent_in_window}"
                      f" sent meanwhile), failed {len(failed)} "
                      f"({sum(o.stream for o in failed)} streams), sent after the kill "
                      f"{len(after)} ({sum(bool(o.error) for o in after)} failed), the other "
                      f"replica served {other_served} from the read on: "
                      f"{[(o.i, o.error) for o in failed][:3]}")
            assert len(outcomes) == total
            assert load >= 1, report  # the kill came mid-load
            assert len(failed) <= load + sent_in_window, report
            assert all(o.stream and o.sent < killed_at for o in failed), report
            assert len(after) >= 40, report
            assert [o for o in after if o.error] == [], report
            assert other_served >= len(after), report
            print(report)


async def raw_request(c: httpx.AsyncClient, i: int, stream: bool) -> None:
    """A completion long enough to be under way at the kill; raises unless it arrives whole
    (200, and for a stream its finish reason and `[DONE]`)."""
    body = {"model": "stub", "prompt": f"request {i}: def step(self):", "max_tokens": 32,
            "ignore_eos": True, "stream": stream}
    if not stream:
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text[:200]
        assert r.json()["choices"][0]["finish_reason"] == "length"
        return
    async with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, (await r.aread())[:200]
        lines = [line async for line in r.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]", lines[-2:]
    assert '"finish_reason":"length"' in lines[-2], lines[-2:]


async def test_a_killed_launcher_leaves_no_child(tmp_path: Path) -> None:
    with trio.fail_after(120):
        async with fleet(tmp_path, n=1) as fl:
            fl.proc.send_signal(signal.SIGKILL)
            await fl.proc.wait()
            # Each child was told to take SIGTERM when the launcher dies (a replica drains
            # first): wait for each to exit, bounded by fail_after.
            for pid in fl.pids():
                await exited(pid)


async def exited(pid: int) -> None:
    """Returns once `pid` has exited (a pidfd turns readable then; Linux 5.3)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        await trio.lowlevel.wait_readable(fd)
    finally:
        os.close(fd)
