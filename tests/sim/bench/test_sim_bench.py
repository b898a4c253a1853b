"""`sim bench`: the SSE parser, the statistics, and the client against real sockets.

The statistics are checked on synthetic records with hand-computed figures. The client runs
against an in-process Hypercorn server on the stub model (token counts are exact: every
load uses ignore_eos and a fixed max_tokens) and against a canned raw-TCP server that
plays other servers' framings: an error frame after the first token, no `[DONE]` (Hugging
Face's `transformers serve`), a stream cut without a finish, a 4xx. No test reads a
stopwatch: the only time-based check is that intervals from one clock overlap at most
`concurrency` deep, which holds exactly.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import pytest
import trio
from support.http_harness import stub_parts
from support.server_harness import live, make_engine

from sim.bench import bench_command
from sim.bench.client import BenchRequest, make_client, prepare_body, run_load, send_one
from sim.bench.prefix import prefix_requests, run_prefix_test
from sim.bench.records import RequestRecord, meets_slo, parse_slo, summarize
from sim.http.sse import SseParser, read_chunk
from sim.load.azure import PromptSynth
from sim.load.spec import parse_load_spec
from sim.load.synthetic import generate_load
from sim.stats import percentile

# ------------------------------------------------------------------------------ SSE parser

STREAM = (b'data: {"choices":[{"index":0,"text":"h\xc3\xa9"}]}\n\n'
          b": a comment line\r\n"
          b"event: message\r\nid: 7\r\ndata: first\r\ndata:second\r\n\r\n"
          b"data: cr\r\r"
          b"data: [DONE]\n\n")
EVENTS = ['{"choices":[{"index":0,"text":"hé"}]}', "first\nsecond", "cr", "[DONE]"]


def test_sse_events_whole() -> None:
    assert SseParser().feed(STREAM) == EVENTS


@pytest.mark.parametrize("cut", range(1, len(STREAM)))
def test_sse_events_split_anywhere(cut: int) -> None:
    # Every cut: inside "é"'s two bytes, between the CR and LF of a CRLF, mid-field.
    p = SseParser()
    assert p.feed(STREAM[:cut]) + p.feed(STREAM[cut:]) + p.close() == EVENTS


def test_sse_byte_at_a_time_and_unterminated_tail() -> None:
    p = SseParser()
    out = [e for i in range(len(STREAM)) for e in p.feed(STREAM[i:i + 1])]
    assert out == EVENTS
    assert p.feed(b"data: tail") == []  # no blank line yet: not dispatched
    assert p.close() == ["tail"]
    assert p.close() == []


def test_read_chunk_kinds() -> None:
    assert read_chunk("[DONE]").done
    err = read_chunk('{"error": {"message": "engine failed", "type": "x", "code": 500}}')
    assert err.error == "engine failed"
    assert not err.has_content
    assert read_chunk("{not json").error is not None
    role = read_chunk('{"choices":[{"index":0,"delta":{"role":"assistant"}}]}')
    assert not role.has_content  # the role delta is not a token
    chat = read_chunk('{"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}')
    assert (chat.text, chat.has_content, chat.finish_reason) == ("Hi", True, None)
    last = read_chunk('{"choices":[{"index":0,"text":"","finish_reason":"length"}],'
                      '"usage":{"prompt_tokens":5,"completion_tokens":6}}')
    assert (last.has_content, last.finish_reason) == (False, "length")
    assert last.usage == {"prompt_tokens": 5, "completion_tokens": 6}


# ------------------------------------------------------------------------------ statistics


def rec(i: int, ttft: float, e2e: float, tokens: int, **kw: Any) -> RequestRecord:
    return RequestRecord(f"r{i}", sent_s=float(i), ok=kw.pop("ok", True), status=200,
                         ttft_s=ttft, e2e_s=e2e, output_tokens=tokens, prompt_tokens=10, **kw)


def test_percentile_interpolates_linearly() -> None:
    xs = [float(x) for x in range(10, 0, -1)]  # 10..1, unsorted on purpose
    assert percentile(xs, 50) == pytest.approx(5.5)
    assert percentile(xs, 90) == pytest.approx(9.1)
    assert percentile(xs, 99) == pytest.approx(9.91)
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 10.0
    assert percentile([3.0], 99) == 3.0
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)


def test_summarize_from_records() -> None:
    records = [
        rec(0, 0.1, 1.1, 11, itl_s=[0.1, 0.3]),  # tpot (1.1 - 0.1) / 10 = 0.1
        rec(1, 0.2, 2.2, 5, itl_s=[0.5]),  # tpot 0.5
        rec(2, 0.3, 0.3, 1),  # one token: no tpot
        rec(3, 0.4, 4.4, 3, itl_s=[2.0]),  # tpot 2.0
        RequestRecord("bad", 4.0, ok=False, status=500, error="HTTP 500: x"),
        RequestRecord("gone", 5.0, ok=False, status=200, hung_up=True, output_tokens=2),
    ]
    s = summarize(records, duration_s=4.0, slo=parse_slo("ttft=250ms,tpot=1s"))
    assert (s["requests"], s["completed"], s["failed"], s["hung_up"]) == (6, 4, 1, 1)
    assert (s["output_tokens"], s["prompt_tokens"]) == (20, 40)
    assert s["request_throughput"] == 1.0
    assert s["output_throughput"] == 5.0
    assert s["total_token_throughput"] == 15.0
    assert s["ttft_ms"] == {"mean": 250.0, "p50": 250.0, "p90": 370.0, "p99": 397.0}
    # tpot over [0.1, 0.5, 2.0]: p50 0.5, p90 at rank 1.8 -> 0.5 + 0.8 * 1.5 = 1.7
    assert s["tpot_ms"] == {"mean": 866.667, "p50": 500.0, "p90": 1700.0, "p99": 1970.0}
    assert s["itl_ms"]["p50"] == 400.0  # pooled gaps [0.1, 0.3, 0.5, 2.0]: rank 1.5
    assert s["e2e_ms"]["mean"] == 2000.0
    # Good: r0 (ttft 100, tpot 100) and r1 (200, 500) and r2 (300 > 250: no) r3 (tpot 2 s: no)
    assert (s["good"], s["goodput"]) == (2, 0.5)
    assert s["slo"] == {"ttft": 250.0, "tpot": 1000.0}
    assert s["first_errors"] == ["HTTP 500: x"]


def test_slo_parsing_and_missing_metrics() -> None:
    assert parse_slo("ttft=2s, tpot=200ms,e2e=.5s") == {"ttft": 2.0, "tpot": 0.2, "e2e": 0.5}
    for bad in ("ttft=200", "itl=1s", "ttft", "ttft=fast"):
        with pytest.raises(ValueError, match="--slo"):
            parse_slo(bad)
    one_token = rec(0, 0.1, 0.1, 1)
    assert meets_slo(one_token, {"tpot": 0.001})  # it has no TPOT to miss
    assert not meets_slo(rec(0, 0.1, 0.1, 1, ok=False), {})


def test_body_preparation() -> None:
    body = {"model": "stub", "prompt": "x", "ignore_eos": True, "stream": False}
    out = prepare_body(body, model="m", stream=True,
                       extra={"ignore_eos": None, "generation_config": "{}"})
    assert out == {"model": "m", "prompt": "x", "stream": True,
                   "stream_options": {"include_usage": True}, "generation_config": "{}"}
    assert body["ignore_eos"] is True  # the source body is not changed
    assert "stream_options" not in prepare_body(out, model="m", stream=False)


# ------------------------------------------------------------------ against the stub server


def stub_requests(n: int, out: int, **spec: Any) -> list[BenchRequest]:
    pairs = ",".join(f"{k}={v}" for k, v in spec.items())
    load = parse_load_spec(f"n={n},rate=100,prompt=uniform:4:40,output=fixed:{out},{pairs}")
    trace = generate_load(load, stub_parts()[1])
    return bench_command.bench_requests(trace, model="stub", stream=True, extra=None)


def max_overlap(records: list[RequestRecord]) -> int:
    """The most requests in flight at once (ends sort before starts at the same time)."""
    edges = sorted([(r.sent_s + (r.e2e_s or 0), -1) for r in records]
                   + [(r.sent_s, 1) for r in records])
    depth = peak = 0
    for _, d in edges:
        depth += d
        peak = max(peak, depth)
    return peak


@pytest.mark.parametrize("concurrency", [1, 3])
async def test_closed_loop_exact_counts(concurrency: int) -> None:
    reqs = stub_requests(7, 9, seed=concurrency)
    tok = stub_parts()[1]
    async with live(make_engine()) as (url, _):
        records, duration = await run_load(url, reqs, concurrency=concurrency)
    assert [r.id for r in records] == [f"r{i}" for i in range(1, 8)]
    for r, q in zip(records, reqs, strict=True):
        assert (r.ok, r.status, r.error, r.hung_up) == (True, 200, None, False)
        assert (r.output_tokens, r.tokens_from) == (9, "usage")
        assert r.prompt_tokens == len(tok.encode(q.body["prompt"]))
        assert 1 <= r.chunks <= 9
        assert len(r.itl_s) == r.chunks - 1
        assert r.ttft_s is not None
        assert r.e2e_s is not None
        assert r.ttft_s <= r.e2e_s
    assert max_overlap(records) <= concurrency
    s = summarize(records, duration)
    assert (s["completed"], s["failed"], s["output_tokens"]) == (7, 0, 63)


async def test_open_loop_chat_and_hangup() -> None:
    reqs = stub_requests(4, 6, api="chat")
    reqs[2] = BenchRequest(reqs[2].id, reqs[2].path, reqs[2].body, reqs[2].at_s,
                           hangup_after_frames=2)
    async with live(make_engine()) as (url, _):
        records, _ = await run_load(url, reqs)
    assert [r.output_tokens for i, r in enumerate(records) if i != 2] == [6, 6, 6]
    gone = records[2]
    assert (gone.hung_up, gone.ok, gone.error) == (True, False, None)
    assert gone.chunks <= 2  # the chat's first frame carries only the role
    assert summarize(records, 1.0)["failed"] == 0
    assert [r.sent_s >= q.at_s for r, q in zip(records, reqs, strict=True)] == [True] * 4


async def test_bench_command_result_schema(tmp_path: Any) -> None:
    p = argparse.ArgumentParser()
    bench_command.add_parser(p.add_subparsers())
    async with live(make_engine()) as (url, _):
        a = p.parse_args(["bench", "--url", url, "--concurrency", "2", "--n", "3",
                          "--prompt", "fixed:8", "--output", "fixed:5", "--slo", "e2e=60s",
                          "--details"])
        result = await bench_command.run_bench(a)
    result = json.loads(json.dumps(result))  # what --out writes
    assert set(result) == {"nanoserve_bench", "date", "label", "url", "model", "source",
                           "mode", "stream", "extra_body", "warmup", "loadavg_before",
                           "summary", "requests"}
    assert (result["model"], result["mode"]) == ("stub", {"closed_loop": 2})
    assert result["source"] == "load n=3,prompt=fixed:8,output=fixed:5"
    s = result["summary"]
    assert (s["completed"], s["output_tokens"], s["prompt_tokens"], s["good"]) == (3, 15, 24, 3)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(s[key]) == {"mean", "p50", "p90", "p99"}
    assert [r["output_tokens"] for r in result["requests"]] == [5, 5, 5]
    assert "ms" in bench_command.format_summary(result)


def test_source_errors(tmp_path: Any) -> None:
    p = argparse.ArgumentParser()
    bench_command.add_parser(p.add_subparsers())
    step = tmp_path / "step.jsonl"
    step.write_text('{"nanoserve_trace": 1, "clock": "step", "model": "stub", "engine": '
                    '{"block_size": 16, "num_blocks": 64, "max_num_seqs": 8, '
                    '"max_num_batched_tokens": 256, "seed": 0}}\n'
                    '{"id": "a", "at_step": 0, "path": "/v1/completions", "body": {}, '
                    '"client": {"read": "eager"}}\n')
    cases = [(["--trace", str(step)], "step-clock"),
             (["--trace", str(step), "--n", "3"], "--n shapes"),
             (["--n", "3"], "needs a rate")]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            bench_command.source(p.parse_args(["bench", *args]))
    trace, how = bench_command.source(p.parse_args(["bench", "--trace", str(step),
                                                "--concurrency", "1"]))
    assert [r.id for r in trace.requests] == ["a"]
    assert how == f"trace {step}"


# -------------------------------------------------- other servers' framings, on raw TCP


@asynccontextmanager
async def canned(body: bytes, status: str = "200 OK", piece: int = 7) -> AsyncIterator[str]:
    """An HTTP/1.1 server that answers every request with `body` (close-delimited), sent
    in `piece`-byte writes."""

    async def handle(stream: trio.SocketStream) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            data += await stream.receive_some(65536)
        head, _, rest = data.partition(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        while len(rest) < length:
            rest += await stream.receive_some(65536)
        await stream.send_all(f"HTTP/1.1 {status}\r\ncontent-type: text/event-stream\r\n"
                              "connection: close\r\n\r\n".encode())
        for i in range(0, len(body), piece):  # small pieces: frames cross TCP sends
            await stream.send_all(body[i:i + piece])
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
        yield f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        nursery.cancel_scope.cancel()


def frames(*objs: Any) -> bytes:
    return b"".join(b"data: " + (o if isinstance(o, bytes) else json.dumps(o).encode())
                    + b"\n\n" for o in objs)


def text(t: str, finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "text": t, "finish_reason": finish}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}
CANNED = [
    pytest.param(frames(text("a"), text("b"), {"error": {"message": "engine failed"}},
                        b"[DONE]"), False, "engine failed", 2, "chunks", id="error-frame"),
    pytest.param(frames(text("a"), text("b"), text("c", "length"), USAGE), True, None, 4,
                 "usage", id="no-done-like-transformers-serve"),
    pytest.param(frames(text("a"), text("bc")) + b"data: " + json.dumps(text("d")).encode(),
                 False, "without a finish_reason", 3, "chunks", id="cut-mid-stream"),
    pytest.param(frames(text("a", "stop"), b"[DONE]", text("after done")), True, None, 1,
                 "chunks", id="nothing-after-done"),
]


@pytest.mark.parametrize(("body", "ok", "error", "tokens", "source"), CANNED)
async def test_other_framings(body: bytes, ok: bool, error: str | None, tokens: int,
                              source: str) -> None:
    req = BenchRequest("x", "/v1/completions", {"prompt": "p", "stream": True})
    # After [DONE] in one write, so that the frame after it comes in the same read as it.
    async with canned(body, piece=len(body) if "after done" in body.decode() else 7) as url, \
            make_client() as client:
        r = await send_one(client, url, req, trio.current_time(), trio.current_time)
    assert (r.ok, r.output_tokens, r.tokens_from) == (ok, tokens, source)
    if error is None:
        assert r.error is None
    else:
        assert r.error is not None
        assert error in r.error
    assert r.chunks == min(tokens, 3)
    assert len(r.itl_s) == r.chunks - 1


async def test_http_error_status() -> None:
    req = BenchRequest("x", "/v1/completions", {"prompt": "p", "stream": True})
    async with canned(b'{"detail": "nope"}', "422 Unprocessable Entity") as url, \
            make_client() as client:
        r = await send_one(client, url, req, trio.current_time(), trio.current_time)
    assert (r.ok, r.status, r.chunks, r.ttft_s) == (False, 422, 0, None)
    assert r.error == 'HTTP 422: {"detail": "nope"}'


def test_cli_dispatch_reports_a_bad_load(capsys: pytest.CaptureFixture[str]) -> None:
    from sim.commands import main

    assert main(["bench", "--url", "http://127.0.0.1:9", "--n", "3"]) == 2
    assert "needs a rate" in capsys.readouterr().err
    assert main(["bench", "--slo", "ttft=2", "--concurrency", "1"]) == 2
    assert "--slo ttft" in capsys.readouterr().err


# ------------------------------------------------------------------------ prefix-cache test


async def test_prefix_test_requests_and_ratio() -> None:
    synth = PromptSynth(stub_parts()[1])
    reqs = prefix_requests(synth, seed=5, model="stub", prefix_tokens=100, n=3)
    systems = [q.body["messages"][0]["content"] for q in reqs]
    users = [q.body["messages"][1]["content"] for q in reqs]
    assert [q.id for q in reqs] == ["warmup", "p1", "p2", "p3"]
    assert systems[1] == systems[2] == systems[3] != systems[0]
    assert len(set(users)) == 4
    assert reqs == prefix_requests(synth, seed=5, model="stub", prefix_tokens=100, n=3)
    assert prefix_requests(synth, seed=6, model="stub", prefix_tokens=100, n=3)[1] != reqs[1]
    async with live(make_engine()) as (url, _), make_client(1) as client:
        res = await run_prefix_test(client, url, reqs, seed=5, prefix_tokens=100)
    assert (res.warmup.id, res.cold.id, [r.id for r in res.warm]) == ("warmup", "p1",
                                                                      ["p2", "p3"])
    # Sequential: each request is sent after the one before it ended.
    done = [res.warmup, res.cold, *res.warm]
    assert all(b.sent_s >= a.sent_s + (a.e2e_s or 0) - 1e-9
               for a, b in itertools.pairwise(done))
    first = done[0].prompt_tokens
    assert first is not None
    assert first > 100
    assert [r.prompt_tokens for r in done] == [first] * 4  # same lengths, template included
    assert [r.output_tokens for r in done] == [4] * 4
    warm = sorted(r.ttft_s or 0 for r in res.warm)
    assert res.ratio == pytest.approx((warm[0] + warm[1]) / 2 / (res.cold.ttft_s or 1))
    assert res.to_json()["requests"][1]["id"] == "p1"


def test_side_by_side_table() -> None:
    from sim.bench.online import side_by_side

    a = summarize([rec(0, 0.1, 1.1, 11)], 2.0)
    b = summarize([rec(0, 0.5, 10.5, 11)], 20.0)
    table = side_by_side({"nanoserve": {"summary": a}, "peer": {"summary": b}}).splitlines()
    assert table[0].split() == ["nanoserve", "peer"]
    rows = {line[:14].strip(): line[14:].split() for line in table[1:]}
    assert rows["output tok/s"] == ["5.5", "0.55"]
    assert rows["TTFT p99 ms"] == ["100.0", "500.0"]
    assert rows["TPOT p50 ms"] == ["100.0", "1000.0"]
