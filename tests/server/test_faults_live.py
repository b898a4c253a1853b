"""Faults that need a real socket or a real thread (issue 9, part 3): a client that sends half
a body and stalls, a client that never reads a long stream, and a step whose worker thread
is stuck. The first two go through Hypercorn on 127.0.0.1, where TCP buffers fill and
Hypercorn's own timers run; the third runs on the live clock, whose steps run in a thread.

Waits are bounded (`trio.fail_after`) so a broken protection fails instead of hanging; no
test measures time. The one real-time wait is the stalled body's timeout, kept short.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio
import trio.testing
from support.fault_harness import BOUND_S, STREAM, Steps, reference
from support.http_harness import hypercorn_on_loopback, serving, stub_parts
from support.server_harness import make_app, make_engine

from nanoserve.bridge.clock import GateClock, LiveClock
from nanoserve.config import EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.model.base import Model
from nanoserve.server import server_state
from sim.replay.faults import FaultyModel

C = "/v1/completions"


@asynccontextmanager
async def hypercorn_with(app: Any, **settings: Any) -> AsyncIterator[tuple[str, int]]:
    """Hypercorn on a free loopback port with some of its own settings; yield (host, port)."""
    async with hypercorn_on_loopback(app, graceful_timeout=2.0, **settings) as url:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        yield host, int(port)


def http_post(body: dict[str, Any], *, send: int | None = None) -> bytes:
    """A raw HTTP/1.1 POST to /v1/completions; with `send`, only that much of the body."""
    raw = json.dumps(body).encode()
    head = (f"POST {C} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n\r\n").encode()
    return head + raw[:send]


async def read_until_closed(stream: trio.SocketStream) -> bytes:
    out = b""
    while chunk := await stream.receive_some():
        out += chunk
    return out


async def test_a_half_body_that_stalls_gets_408_through_hypercorn() -> None:
    engine = make_engine()
    app = make_app(engine, clock=LiveClock(), body_timeout=0.6)
    # Hypercorn's keep-alive timer is shorter than the body timeout: were a stalled body an
    # idle connection to it, the client would see the socket close with no answer at all.
    async with hypercorn_with(app, keep_alive_timeout=0.2) as (host, port):
        sock = await trio.open_tcp_stream(host, port)
        await sock.send_all(http_post({**STREAM, "max_tokens": 4}, send=30))
        with trio.fail_after(BOUND_S):
            answer = await read_until_closed(sock)  # the server closes after its 408
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408")
        err = json.loads(body)["error"]
        assert (err["code"], err["type"]) == ("body_timeout", "invalid_request_error")
        assert "0.6 s" in err["message"]
        await sock.aclose()
        bridge = server_state(app).ready.bridge  # type: ignore[union-attr]
        s = bridge.statistics()
        assert (s.admitted, s.in_flight, s.queued, s.steps) == (0, 0, 0, 0)  # nothing queued
        # The server keeps serving.
        sock = await trio.open_tcp_stream(host, port)
        await sock.send_all(http_post({**STREAM, "max_tokens": 4, "stream": False}).replace(
            b"Host: test", b"Host: test\r\nConnection: close"))
        with trio.fail_after(BOUND_S):
            ok = await read_until_closed(sock)
        await sock.aclose()
        assert ok.startswith(b"HTTP/1.1 200")
        assert json.loads(ok.partition(b"\r\n\r\n")[2])["usage"]["completion_tokens"] == 4


async def never_reader(host: str, port: int, body: dict[str, Any]) -> trio.SocketStream:
    """A client with a small receive window that sends its request and never reads."""
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect((host, port))
    stream = trio.SocketStream(sock)
    await stream.send_all(http_post(body))
    return stream


def count_arrivals(registry: Any) -> trio.Semaphore:
    """A semaphore released each time a request reaches the registry. Over TCP there is no
    task to wait for (`wait_all_tasks_blocked` cannot see bytes in a kernel buffer)."""
    arrivals = trio.Semaphore(0)
    real_open = registry.open

    def open_and_tell(*args: Any, **kwargs: Any) -> Any:
        job = real_open(*args, **kwargs)
        arrivals.release()
        return job

    registry.open = open_and_tell
    return arrivals


async def arrived(arrivals: trio.Semaphore) -> None:
    with trio.fail_after(BOUND_S):
        await arrivals.acquire()


async def eager_run(with_never_reader: bool) -> tuple[list[int], Any]:
    """An eager 300-token stream, beside a never-reading one or alone: the eager request's
    token steps, and (with the never-reader) what its hang-up left behind."""
    gate = GateClock()
    engine = make_engine(max_model_len=4096, num_blocks=1024)
    app = make_app(engine, clock=gate)
    eager = {**STREAM, "max_tokens": 300, "seed": 1}
    # 32 choices, a frame each per step: ~10,000 frames (1.5 MB) fill any socket buffer.
    unread = {**STREAM, "max_tokens": 2000, "seed": 2, "n": 32}
    async with hypercorn_with(app) as (host, port):
        steps = Steps(app)
        registry = server_state(app).ready.registry  # type: ignore[union-attr]
        arrivals = count_arrivals(registry)
        silent = None
        if with_never_reader:
            silent = await never_reader(host, port, unread)
            await arrived(arrivals)
        reader = await trio.open_tcp_stream(host, port)
        await reader.send_all(http_post(eager).replace(b"Host: test",
                                                      b"Host: test\r\nConnection: close"))
        await arrived(arrivals)
        gate.release(300)  # both are queued: they join step 1 together
        with trio.fail_after(BOUND_S):
            got = await read_until_closed(reader)
        assert got.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")  # [DONE], the last chunk
        eager_id = "cmpl-1" if with_never_reader else "cmpl-0"
        if silent is None:
            return steps.steps(eager_id), None
        # Every task is blocked and the never-reader's job still holds frames: its handler
        # is stuck on the full socket, and its frames pile up in the job's queue, not in
        # the engine's way.
        await trio.testing.wait_all_tasks_blocked(cushion=0.1)
        (job,) = [j for j in registry._jobs.values()]  # noqa: SLF001 (a test's look inside)
        backlog = job._recv.statistics().current_buffer_used  # noqa: SLF001
        await silent.aclose()  # it hangs up at last (unread bytes: the kernel sends RST)
        with trio.fail_after(BOUND_S):
            await registry.wait_empty()
        gate.release(1)  # the boundary that applies the abort
        await trio.testing.wait_all_tasks_blocked()
        s = engine.statistics()
        left = (backlog, steps.steps("cmpl-0")[-1], gate.steps_run, s.aborted,
                s.free_blocks == s.num_blocks, s.running + s.waiting)
        return steps.steps(eager_id), left


async def test_a_client_that_never_reads_does_not_slow_the_batch() -> None:
    alone, _ = await eager_run(with_never_reader=False)
    beside, left = await eager_run(with_never_reader=True)
    assert alone == list(range(1, 301))
    assert beside == alone  # the same steps, to the step, with the silent client there
    backlog, unread_last_step, steps_run, aborted, all_free, live = left
    assert backlog > 0  # its handler was blocked on the full socket meanwhile
    assert unread_last_step == 300  # it ran every step until it hung up ...
    assert (steps_run, aborted, all_free, live) == (300, 1, True, 0)  # ... then was aborted


class StuckModel(FaultyModel):
    """The stub, whose step `at` blocks its worker thread until the test lets it go."""

    def __init__(self, inner: Model, at: int) -> None:
        super().__init__(inner, ())
        self.at = at
        self.entered = threading.Event()
        self.go = threading.Event()
        self.stuck = False

    def _check(self) -> None:
        if self._step() == self.at:
            self.stuck = True
            self.entered.set()
            self.go.wait(10)  # bounded: a mutated clock that runs steps inline still ends
            self.stuck = False


async def test_a_stuck_step_thread_leaves_the_server_answering() -> None:
    model, tok = stub_parts()
    stuck = StuckModel(model, at=1)
    engine = Engine(stuck, tok, EngineConfig(block_size=16, num_blocks=128, max_model_len=1024))
    stuck.attach(engine)
    app = make_app(engine, clock=LiveClock())
    later_body = {**STREAM, "prompt": "Tell me a story", "seed": 5}
    async with serving(app) as h:
        steps = Steps(app)
        bridge = server_state(app).ready.bridge  # type: ignore[union-attr]
        first = await h.open("POST", C, json_body=STREAM)
        with trio.fail_after(BOUND_S):
            await trio.to_thread.run_sync(stuck.entered.wait)
        for path in ("/health", "/v1/models", "/metrics"):
            assert (await h.request("GET", path)).status == 200
        later = await h.open("POST", C, json_body=later_body)
        # A large body is parsed and prepared in a worker thread (server/offload.py), which
        # wait_all_tasks_blocked does not wait for: the wait holds whichever path it took.
        with trio.fail_after(BOUND_S):
            while bridge.statistics().queued == 0:  # noqa: ASYNC110
                await trio.lowlevel.checkpoint()
        await trio.testing.wait_all_tasks_blocked()
        assert bridge.statistics().queued == 1  # accepted, waiting for the next boundary
        first.disconnect()  # a hang-up during the stuck step
        await trio.testing.wait_all_tasks_blocked()
        assert stuck.stuck  # all of the above happened while step 1 was still running
        stuck.go.set()
        with trio.fail_after(BOUND_S):
            r = await later.read_all()
            await bridge.wait_idle()
        assert r.status == 200
        assert steps.steps("cmpl-0") == [1]  # step 1 finished; boundary 2 applied the abort
        assert steps.steps("cmpl-1") == list(range(2, 12))
        assert steps.tokens("cmpl-1") == (await reference(later_body))[0]
        s = engine.statistics()
        assert (s.aborted, s.running, s.waiting, s.free_blocks) == (1, 0, 0, s.num_blocks)
