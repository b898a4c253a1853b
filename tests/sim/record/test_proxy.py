"""`sim record --upstream`: the recording proxy (sim/record/upstream.py) between real
sockets. It forwards the upstream's bytes unchanged, passes a client's hang-up on, and
writes a trace that `sim replay` repeats on nanoserve with every expectation met.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import trio
from support.server_harness import make_engine
from support.toy_server import Toy

from nanoserve.bridge.clock import LiveClock
from nanoserve.server import ServerConfig, create_app
from sim.http.loopback import hypercorn_on_loopback
from sim.load.azure import default_engine
from sim.record.upstream import Proxy
from sim.replay.run import replay
from sim.target import answer, load, wire
from sim.target.target import Target
from sim.trace.format import TraceHeader
from sim.trace.journal import INCOMPLETE, JournalWriter
from sim.trace.loader import load_trace
from sim.trace.write import dumps_line, header_object

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@asynccontextmanager
async def proxied(app: Any) -> AsyncIterator[tuple[str, str, Proxy]]:
    """`app` on a socket and the proxy in front of it: (upstream URL, proxy URL, proxy)."""
    async with hypercorn_on_loopback(app) as up, httpx.AsyncClient() as client:
        proxy = Proxy(up, client)
        async with hypercorn_on_loopback(proxy) as url:
            yield up, url, proxy


async def test_the_answers_pass_through_unchanged() -> None:
    unary = {"model": "toy", "prompt": "café 🎉", "max_tokens": 20, "logprobs": 1}
    async with proxied(Toy()) as (up, url, proxy), wire.make_client() as cl:
        for body in (unary, {**unary, "stream": True}):
            straight = await wire.send(cl, up, COMPLETIONS, body)
            through = await wire.send(cl, url, COMPLETIONS, body)
            assert (through.status, through.raw) == (straight.status, straight.raw)
            assert [f.data for f in through.frames] == [f.data for f in straight.frames]
            assert through.headers["content-type"] == straight.headers["content-type"]
        models = await cl.get(url + "/v1/models")  # forwarded, not recorded
    assert models.json() == {"object": "list", "data": [{"id": "toy"}]}
    assert [(e.path, e.status, e.hung_up) for e in proxy.exchanges] == [
        (COMPLETIONS, 200, False), (COMPLETIONS, 200, False)]


async def test_a_hang_up_reaches_the_upstream() -> None:
    async with proxied(Toy()) as (_, url, proxy), wire.make_client() as cl:
        o = await load.hangup_frees_slot(Target(url, cl, "toy", settle_s=2.0))
    assert o.status == "pass", o
    assert proxy.exchanges[-1].hung_up


async def test_a_recorded_trace_replays_on_nanoserve_with_every_expectation_met() -> None:
    app = create_app(make_engine(max_model_len=4096, num_blocks=2048), ServerConfig("stub"),
                     clock=LiveClock())
    greedy = {"model": "stub", "prompt": "Hello", "max_tokens": 12, "temperature": 0}
    sends: list[tuple[str, Any, int | None]] = [
        (COMPLETIONS, greedy, None),
        (COMPLETIONS, {**greedy, "stream": True}, None),
        (COMPLETIONS, {**greedy, "max_tokens": 500, "ignore_eos": True, "stream": True}, 3),
        (CHAT, {"model": "stub", "messages": "not a list"}, None),
        (COMPLETIONS, {**greedy, "n": 3, "temperature": 0.8, "seed": 5}, None),
        (COMPLETIONS, b'{"model": "stub", "prompt": "x", "temperature": NaN}', None),
    ]
    async with proxied(app) as (_, url, proxy), wire.make_client() as cl:
        seen = [await wire.send(cl, url, path, body, hangup_after_frames=k)
                for path, body, k in sends]
    trace = proxy.trace("stub", default_engine(), "through the proxy")
    # The frames the proxy had sent when it saw the hang-up: the client read 3, and a
    # frame sent as it closed may be counted too (a proxy cannot see what was read).
    hangups = [r.client.hangup_after_frames for r in trace.requests]
    assert hangups[:2] + hangups[3:] == [None] * 5
    assert hangups[2] in (3, 4)
    assert [r.at_s for r in trace.requests] == sorted(r.at_s or 0 for r in trace.requests)
    by_id = {e.id: e.fields for e in trace.expectations}
    assert sorted(by_id) == ["r1", "r2", "r4", "r5", "r6"]  # a hang-up has none to expect
    assert trace.requests[5].raw_body == sends[5][1]  # a NaN: kept as the bytes sent
    assert by_id["r6"]["status"] == 400
    assert by_id["r1"]["text"] == answer.read(seen[0]).text()
    assert by_id["r2"]["frames"] == len(seen[1].frames)
    assert by_id["r4"] == {"status": 400, "error": "invalid_value"}
    assert [c["text"] for c in by_id["r5"]["choices"]] == [
        answer.read(seen[4]).text(i) for i in range(3)]
    result = await trio.to_thread.run_sync(lambda: replay(trace))
    assert result.mismatches == ()
    assert result.ok
    assert result.expectations_checked


async def test_a_kill_keeps_every_exchange_that_ended(tmp_path: Path) -> None:
    # The journal as `sim record` writes it: a header saying it is unfinished, then each
    # exchange as it ends. Read without the proxy's clean stop, as after a SIGKILL.
    path = tmp_path / "proxied.jsonl"
    journal = JournalWriter(path)
    header = TraceHeader("virtual", "toy", default_engine(), note="test")
    journal.write(dumps_line({**header_object(header), INCOMPLETE: "still running"}))
    greedy = {"model": "toy", "prompt": "café", "max_tokens": 6, "temperature": 0}
    async with hypercorn_on_loopback(Toy()) as up, httpx.AsyncClient() as client:
        proxy = Proxy(up, client, journal)
        async with hypercorn_on_loopback(proxy) as url, wire.make_client() as cl:
            first = await wire.send(cl, url, COMPLETIONS, greedy)
            await wire.send(cl, url, COMPLETIONS, {**greedy, "max_tokens": 2000, "stream": True},
                            hangup_after_frames=1)
    trace = load_trace(path)
    assert [r.id for r in trace.requests] == ["r1", "r2"]
    assert trace.requests[0].client.hangup_after_frames is None
    assert (trace.requests[1].client.hangup_after_frames or 0) >= 1  # sent, not all read
    assert [(e.id, e.fields["text"]) for e in trace.expectations] == [
        ("r1", answer.read(first).text())]
    assert "recovered from a recording that did not finish" in (trace.header.note or "")
