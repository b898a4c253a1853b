"""`nanoserve serve --record`: live traffic on a real socket, written as a trace, replayed
(with speculative decoding too, at the end).

The stub cases run an in-process Hypercorn on 127.0.0.1 under the gate clock, so the test
decides which boundary every arrival and hang-up lands on and can assert exact `at_step`,
`hangup_at_step`, frames and steps; the clients are raw sockets (a thread-run HTTP client
would be invisible to `wait_all_tasks_blocked`). Each recorded trace is then replayed by
`sim.replay.run` and must come out clean. The `real` case is the issue's must-show: SmolLM2 on
the live clock, several clients, one hanging up mid-stream, one giving up on a unary
request, recorded and replayed with the same tokens.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from support.http_harness import hypercorn_on_loopback, serving, sse_events
from support.server_harness import make_engine

from nanoserve.bridge import AsyncEngine
from nanoserve.bridge.clock import Clock, GateClock, LiveClock
from nanoserve.config import SpeculativeConfig
from nanoserve.engine.engine import Engine
from nanoserve.server import ServerConfig, counter_ids, create_app, server_state
from sim.record.recorder import TraceRecorder, model_sha256
from sim.record.trace import frames_by_step
from sim.trace.format import FramesByStep, Trace
from sim.trace.loader import load_trace

PROMPT = "def step(self):"


@asynccontextmanager
async def recorded(engine: Engine, clock: Clock, path: Path, name: str = "stub",
                   config: ServerConfig | None = None,
                   **kw: Any) -> AsyncIterator[tuple[str, AsyncEngine, TraceRecorder]]:
    """A recording server on a free loopback port; yields (host:port, bridge, recorder). The
    trace is written when the block ends and the server has shut down."""
    rec = TraceRecorder(path, **kw)
    app = create_app(engine, config or ServerConfig(name), clock=clock, id_source=counter_ids(),
                     time_source=lambda: 1_700_000_000.0, recorder=rec)
    async with hypercorn_on_loopback(app) as url:
        ready = server_state(app).ready
        assert ready is not None
        yield url.removeprefix("http://"), ready.bridge, rec


class Raw:
    """One HTTP/1.1 request on its own socket (`Connection: close`), read as it arrives."""

    def __init__(self, sock: trio.SocketStream) -> None:
        self.sock = sock
        self.data = b""

    @classmethod
    async def post(cls, addr: str, body: dict[str, Any],
                   path: str = "/v1/completions") -> Raw:
        host, port = addr.rsplit(":", 1)
        sock = await trio.open_tcp_stream(host, int(port))
        raw = json.dumps(body).encode()
        await sock.send_all(
            f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Connection: close\r\nContent-Length: {len(raw)}\r\n\r\n".encode() + raw)
        return cls(sock)

    def events(self) -> list[str]:
        """SSE payloads of the complete events so far ([DONE] included)."""
        _, _, body = self.data.partition(b"\r\n\r\n")
        return sse_events(_unchunk(body).rpartition(b"\n\n")[0] + b"\n\n")

    async def read_frames(self, n: int) -> list[str]:
        while len([e for e in self.events() if e != "[DONE]"]) < n:
            chunk = await self.sock.receive_some()
            assert chunk, "the server closed the connection early"
            self.data += chunk
        return self.events()

    def complete(self) -> bool:
        head, sep, body = self.data.partition(b"\r\n\r\n")
        if not sep:
            return False
        if b"transfer-encoding: chunked" in head.lower():
            return body.endswith(b"0\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        return len(body) >= length

    async def read_all(self) -> bytes:
        """The whole response (Hypercorn keeps the connection open after it)."""
        while not self.complete():
            chunk = await self.sock.receive_some()
            assert chunk, "the server closed the connection early"
            self.data += chunk
        await self.sock.aclose()
        return self.data

    def json(self) -> Any:
        head, _, body = self.data.partition(b"\r\n\r\n")
        return json.loads(_unchunk(body) if b"chunked" in head.lower() else body)


def _unchunk(body: bytes) -> bytes:
    """The payload of an HTTP/1.1 chunked body (as far as it has arrived)."""
    out, rest = b"", body
    while rest:
        size_line, sep, rest = rest.partition(b"\r\n")
        if not sep or not size_line:
            break
        size = int(size_line, 16)
        out, rest = out + rest[:size], rest[size + 2:]
    return out


def stream_text(events: list[str]) -> str:
    return "".join(c.get("text", "") for e in events if e != "[DONE]"
                   for c in json.loads(e).get("choices", []))


async def settle() -> None:
    await trio.testing.wait_all_tasks_blocked()


def lines(trace: Trace) -> dict[str, dict[str, Any]]:
    return {e.id: e.fields for e in trace.expectations}


async def replay_in_thread(path: Path, **kw: Any) -> Any:
    from sim.replay.run import replay

    return await trio.to_thread.run_sync(partial(replay, path, **kw))


# ---------------------------------------------------------------------------- the stub


async def test_records_exact_boundaries_and_replays_clean(tmp_path: Path) -> None:
    gate, path = GateClock(), tmp_path / "live.jsonl"
    async with recorded(make_engine(), gate, path) as (addr, bridge, _):
        a = await Raw.post(addr, {"model": "stub", "prompt": PROMPT, "max_tokens": 6,
                                  "seed": 1, "stream": True})
        await settle()
        assert bridge.statistics().queued == 1
        gate.release(2)  # boundary 0 takes A; steps 1 and 2
        await settle()
        b = await Raw.post(addr, {"model": "stub", "prompt": "The quick", "max_tokens": 3,
                                  "seed": 2})
        await settle()  # one at a time: the bridge takes them in this order
        c = await Raw.post(addr, {"model": "stub", "prompt": PROMPT, "max_tokens": 40,
                                  "stream": True})
        await settle()
        gate.release(2)  # boundary 2 takes B and C; steps 3 and 4
        await settle()
        c_events = await c.read_frames(2)
        await c.sock.aclose()  # C hangs up having read steps 3 and 4
        await settle()
        d = await Raw.post(addr, {"model": "stub", "prompt": "Hello there", "max_tokens": 50})
        await settle()
        gate.release(1)  # boundary 4 aborts C and takes D; step 5
        await settle()
        await d.sock.aclose()  # D gives up on its unary answer
        await settle()
        gate.release(20)  # boundary 5 aborts D; A and B run to their ends
        a_body, b_body = await a.read_all(), await b.read_all()
        await settle()
        assert gate.steps_run == 6
    a_events = a.events()
    assert a_body.startswith(b"HTTP/1.1 200")
    assert b_body.startswith(b"HTTP/1.1 200")

    trace = load_trace(path)  # the loader accepts what the recorder wrote
    assert [(r.id, r.at_step, r.client.hangup_at_step) for r in trace.requests] == [
        ("r1", 0, None), ("r2", 2, None), ("r3", 2, 4), ("r4", 4, 5)]
    assert all(r.client.read == "eager" for r in trace.requests)
    assert trace.header.model == "stub"
    assert trace.header.clock == "step"
    assert trace.header.engine["num_blocks"] == 128
    assert trace.header.engine["block_size"] == 16
    e = lines(trace)
    assert (e["r1"]["status"], e["r1"]["first_token_step"], e["r1"]["last_step"]) == (200, 1, 6)
    assert e["r1"]["completion_tokens"] == 6
    assert e["r1"]["finish_reason"] == "length"
    assert e["r1"]["text"] == stream_text(a_events)
    assert e["r1"]["frames"] == len(a_events) - 1  # [DONE] is not a frame
    assert e["r2"]["text"] == b.json()["choices"][0]["text"]
    assert (e["r2"]["first_token_step"], e["r2"]["last_step"]) == (3, 5)
    # C: read two frames, hung up; the engine made tokens at steps 3 and 4 only.
    assert (e["r3"]["frames"], e["r3"]["hangup_step"], e["r3"]["aborted"]) == (2, 4, True)
    assert e["r3"]["text"] == stream_text(c_events)
    assert (e["r3"]["completion_tokens"], e["r3"]["last_step"]) == (2, 4)
    # D: no status line ever went out; its one token came from step 5, its prefill.
    assert "status" not in e["r4"]
    assert e["r4"]["hangup_step"] == 5
    assert (e["r4"]["completion_tokens"], e["r4"]["last_step"], e["r4"]["frames"]) == (1, 5, 0)
    # Each request fits one block; at most three ran at once (A, B, C; then A, B, D).
    assert e["end"] == {"steps": 6, "free_blocks": 128, "peak_used_blocks": 3,
                        "preemptions": 0, "num_blocks": 128, "aborted": 2}

    result = await replay_in_thread(path)
    assert result.mismatches == ()
    assert [r.fields()["token_ids"] for r in result.outcome.requests] == [
        e[f"r{i}"]["token_ids"] for i in range(1, 5)]


class Events:
    """A BridgeRecorder that writes down what the bridge tells it."""

    def __init__(self, fail: bool = False) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.fail = fail

    def boundary(self, step: int, aborted: Any, arrived: Any) -> None:
        self.log.append(("boundary", step, list(aborted), list(arrived)))
        if self.fail:
            raise RuntimeError("a recorder bug")

    def update(self, step: int, update: Any) -> None:
        self.log.append(("update", step, update.request_id, len(update.new_token_ids),
                         update.finish_reason))
        if self.fail:
            raise RuntimeError("a recorder bug")


@pytest.mark.parametrize("fail", [False, True], ids=["events", "a-failing-recorder"])
async def test_the_bridge_tells_the_recorder_each_boundary_and_update(fail: bool) -> None:
    """The hook's contract, exactly; and a recorder that raises changes nothing served."""
    from nanoserve.sampling.params import SamplingParams

    gate, events = GateClock(), Events(fail)
    async with AsyncEngine.open(make_engine(), gate, events) as bridge:
        a = bridge.stream(PROMPT, SamplingParams(max_tokens=3, seed=1), "a")
        b = bridge.stream(PROMPT, SamplingParams(max_tokens=9, seed=1), "b")
        gate.release(2)
        await settle()
        b.close()  # b's reader leaves after step 2: aborted at boundary 2
        gate.release(5)
        outputs = [u async for u in a]
    assert [len(u.new_token_ids) for u in outputs] == [1, 1, 1]
    assert outputs[-1].finish_reason == "length"
    assert events.log == [
        ("boundary", 0, [], ["a", "b"]),
        ("update", 1, "a", 1, None), ("update", 1, "b", 1, None),
        ("boundary", 1, [], []),
        ("update", 2, "a", 1, None), ("update", 2, "b", 1, None),
        ("update", 2, "b", 0, "abort"), ("boundary", 2, ["b"], []),
        ("update", 3, "a", 1, "length"),
    ]


class HeldClock(GateClock):
    """The live clock's race, on cue: a step, once computed, is held (its updates not yet
    delivered) until the test calls `finish()`, so a client can leave while it "runs"."""

    def __init__(self) -> None:
        super().__init__()
        self._finish = trio.Semaphore(0)

    def finish(self) -> None:
        self._finish.release()

    async def run_step(self, step: Any) -> Any:
        result = await super().run_step(step)
        await self._finish.acquire()
        return result


async def test_a_client_gone_while_a_step_runs(tmp_path: Path) -> None:
    """The client read two frames and left while step 3 ran: the abort came at boundary 3,
    after the engine had made a third token whose frame was never sent. So the trace says
    hangup_at_step 3 (the engine's truth) and reads only two frames by then (the client's);
    an eager reader hung up at step 3 would have read three. B, sent while step 3 ran, was
    received after two steps but taken at boundary 3: its at_step is 3."""
    clock, path = HeldClock(), tmp_path / "race.jsonl"
    async with recorded(make_engine(), clock, path) as (addr, _, _):
        a = await Raw.post(addr, {"model": "stub", "prompt": "The quick", "max_tokens": 20,
                                  "seed": 2, "stream": True})
        await settle()
        for _ in range(2):
            clock.release(1)
            clock.finish()
            await settle()
        clock.release(1)  # step 3 is computed, and held
        await settle()
        b = await Raw.post(addr, {"model": "stub", "prompt": "Hello", "max_tokens": 2})
        events = await a.read_frames(2)
        await a.sock.aclose()
        await settle()
        clock.finish()  # step 3 ends; boundary 3 applies the abort and takes B
        for _ in range(2):
            clock.release(1)
            clock.finish()
            await settle()
        await b.read_all()
        assert clock.steps_run == 5
    trace = load_trace(path)
    req, later = trace.requests
    assert (later.at_step, lines(trace)["r2"]["first_token_step"]) == (3, 4)
    assert req.client.hangup_at_step == 3
    assert req.client.read == FramesByStep(((1, 1), (2, 2), (3, 2)))
    e = lines(trace)["r1"]
    assert (e["frames"], e["completion_tokens"], e["last_step"]) == (2, 3, 3)
    assert e["text"] == stream_text(events)
    assert (await replay_in_thread(path)).mismatches == ()


def test_frames_by_step_pairs() -> None:
    assert frames_by_step([1, 1, 2, 5], None) == ((1, 2), (2, 3), (5, 4))
    assert frames_by_step([1, 2], 4) == ((1, 1), (2, 2), (4, 2))  # a last pair at the hang-up
    assert frames_by_step([], 3) == ((3, 0),)
    read = FramesByStep(((1, 2), (2, 3), (5, 4)))
    assert [read.allowed(s) for s in range(7)] == [0, 2, 3, 3, 3, 4, None]


async def test_a_slow_reader_is_recorded_frame_by_step(tmp_path: Path) -> None:
    """The transport held the first frame while steps 2 and 3 ran (a socket pushing back),
    so the trace says when each frame was taken; the replay reads at that pace."""
    gate, path = GateClock(), tmp_path / "slow.jsonl"
    rec = TraceRecorder(path)
    app = create_app(make_engine(), ServerConfig("stub"), clock=gate, id_source=counter_ids(),
                     time_source=lambda: 0.0, recorder=rec)
    taken: list[dict[str, Any]] = []
    reading = trio.Event()

    async def send(msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.body":
            await reading.wait()  # a socket buffer that is full until the client reads
        taken.append(msg)

    body = json.dumps({"model": "stub", "prompt": "The quick", "max_tokens": 6, "seed": 2,
                       "temperature": 0.0, "stream": True}).encode()
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await trio.sleep_forever()  # the client never hangs up
        raise AssertionError

    async with serving(app) as harness:
        harness.nursery.start_soon(app, scope("/v1/completions", body), receive, send)
        await settle()
        gate.release(1)  # step 1 makes the first frame, and its send blocks
        await settle()
        gate.release(2)  # it waits at the transport through steps 2 and 3
        await settle()
        assert [m["type"] for m in taken] == ["http.response.start"]
        reading.set()
        await settle()
        for _ in range(3):  # from here on each frame goes out in the step that made it
            gate.release(1)
            await settle()
    events = sse_events(b"".join(m.get("body", b"") for m in taken))
    trace = load_trace(path)
    (req,) = trace.requests
    frames = len(events) - 1
    assert frames == 6  # these six tokens are whole words: one frame each
    assert req.client.read == FramesByStep(((3, 3), (4, 4), (5, 5), (6, 6)))
    assert lines(trace)["r1"]["frames"] == 6
    result = await replay_in_thread(path)
    assert result.mismatches == ()


def scope(path: str, body: bytes) -> dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.1"},
        "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
        "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000), "extensions": {},
    }  # fmt: skip


async def test_refusals_several_prompts_and_n_replay_clean(tmp_path: Path) -> None:
    """A 400 (recorded where it was received, with its error code), a request whose body is
    not JSON (recorded as its bytes, refused again on replay), two prompts with n=2, and a
    chat request."""
    path = tmp_path / "mixed.jsonl"
    async with recorded(make_engine(), LiveClock(), path) as (addr, _, _):
        bad = await Raw.post(addr, {"model": "stub", "prompt": PROMPT, "temperature": -1})
        assert (await bad.read_all()).startswith(b"HTTP/1.1 400")
        host, port = addr.rsplit(":", 1)
        sock = await trio.open_tcp_stream(host, int(port))
        await sock.send_all(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 3"
                            b"\r\n\r\n{x}")
        assert (await Raw(sock).read_all()).startswith(b"HTTP/1.1 400")
        two = await Raw.post(addr, {"model": "stub", "prompt": [PROMPT, "The quick"], "n": 2,
                                    "max_tokens": 4, "seed": 9, "stream": True})
        await two.read_all()
        chat = await Raw.post(addr, {"model": "stub", "max_tokens": 5, "messages": [
            {"role": "user", "content": "Hi"}]}, path="/v1/chat/completions")
        await chat.read_all()
    trace = load_trace(path)
    # Refusals never reach the bridge: they follow the requests it took at that step.
    assert [(r.id, r.at_step, r.body.get("n"), r.raw_body) for r in trace.requests] == [
        ("r1", 0, 2, None), ("r2", 0, None, None), ("r3", 0, None, b"{x}"),
        ("r4", 4, None, None)]
    e = lines(trace)
    assert (e["r2"]["status"], e["r2"]["error"], e["r2"]["token_ids"]) == (400, "invalid_value",
                                                                          [])
    assert (e["r3"]["status"], e["r3"]["error"]) == (400, "invalid_json")
    assert e["r1"]["completion_tokens"] == 16
    assert len(e["r1"]["choices"]) == 4
    texts: dict[int, str] = {}
    for ev in two.events():
        if ev != "[DONE]":
            for c in json.loads(ev)["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert [c["text"] for c in e["r1"]["choices"]] == [texts[i] for i in range(4)]
    assert e["r4"]["text"] == chat.json()["choices"][0]["message"]["content"]
    result = await replay_in_thread(path)
    assert result.mismatches == ()


async def test_tool_requests_are_recorded_with_the_servers_settings(tmp_path: Path) -> None:
    """serve --record with --chat-template chatml-tools --enable-auto-tool-choice: the
    header keeps those settings, each request's tool calls are its expectation, and the
    trace replays clean (on a server the replay sets up from the header alone)."""
    from nanoserve.server import checks
    from nanoserve.server.settings import AgentSettings

    config = ServerConfig("stub", chat_template=checks.chat_template("chatml-tools"),
                          agents=AgentSettings(enable_auto_tool_choice=True))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    path = tmp_path / "tools.jsonl"
    async with recorded(make_engine(), LiveClock(), path, config=config) as (addr, _, _):
        for stream in (True, False):
            r = await Raw.post(addr, {"model": "stub", "max_tokens": 40, "temperature": 0,
                                      "stream": stream, "tools": tools, "messages": [
                                          {"role": "user", "content": f"⟪say⟫{call}⟪/say⟫"}]},
                               path="/v1/chat/completions")
            await r.read_all()
    trace = load_trace(path)
    assert trace.header.server == {"chat_template": config.chat_template,
                                   "enable_auto_tool_choice": True}
    assert [e["tool_calls"] for e in lines(trace).values() if "tool_calls" in e] == [
        [["get_weather", '{"city": "Oslo"}']]] * 2
    result = await replay_in_thread(path)
    assert result.mismatches == ()


# ---------------------------------------------------------------------------- SmolLM2


@pytest.mark.real
async def test_live_smollm2_traffic_replays_with_the_same_tokens(
    tmp_path: Path, smollm2_model: Any, smollm2_tokenizer: Any
) -> None:
    """The must-show: a live server on a real socket (the live clock: steps in a worker
    thread, every arrival and hang-up wherever the wall clock put it), SmolLM2, five
    clients: one hangs up mid-stream, one gives up on a unary request, three finish."""
    import openai

    from nanoserve.config import EngineConfig
    from nanoserve.engine.outputs import StepResult

    engine = Engine(smollm2_model, smollm2_tokenizer,
                    EngineConfig(block_size=16, num_blocks=256, max_model_len=2048))
    path = tmp_path / "smollm2.jsonl"
    got: dict[str, Any] = {}
    async with recorded(engine, LiveClock(), path, name="smollm2",
                        weights="smollm2") as (addr, bridge, _):
        made = {"cmpl-giveup": 0}
        enough = trio.Event()

        def on_step(result: StepResult) -> None:
            for u in result.updates:
                if u.request_id in made:
                    made[u.request_id] += len(u.new_token_ids)
                    if u.finished:  # (cannot happen before 64 tokens; never wait forever)
                        enough.set()
            if made["cmpl-giveup"] >= 3:
                enough.set()

        bridge.add_step_listener(on_step)
        cl = openai.OpenAI(base_url=f"http://{addr}/v1", api_key="unused", max_retries=0,
                           timeout=300)

        async def unary() -> None:
            got["unary"] = await trio.to_thread.run_sync(lambda: cl.completions.create(
                model="smollm2", prompt="The capital of France is", max_tokens=12,
                temperature=0))

        async def stream() -> None:
            got["stream"] = await trio.to_thread.run_sync(lambda: list(cl.completions.create(
                model="smollm2", prompt="Once upon a time", max_tokens=16, seed=3,
                temperature=0.8, stream=True)))

        async def chat() -> None:
            got["chat"] = await trio.to_thread.run_sync(lambda: cl.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": "Name a color."}],
                max_tokens=10, seed=5))

        async def hang_up() -> None:
            c = await Raw.post(addr, {"model": "smollm2", "prompt": "List the planets:",
                                      "max_tokens": 64, "ignore_eos": True, "stream": True})
            got["hang"] = [e for e in await c.read_frames(3) if e != "[DONE]"]
            await c.sock.aclose()

        async def give_up() -> None:
            host, port = addr.rsplit(":", 1)
            sock = await trio.open_tcp_stream(host, int(port))
            raw = json.dumps({"model": "smollm2", "prompt": "Write a long poem about the sea.",
                              "max_tokens": 64, "ignore_eos": True}).encode()
            await sock.send_all(
                b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json"
                b"\r\nX-Request-Id: giveup\r\nContent-Length: " + str(len(raw)).encode()
                + b"\r\n\r\n" + raw)
            await enough.wait()  # it has seen three tokens made, and no answer: it leaves
            await sock.aclose()

        # A bound, not a stopwatch: a client that never finishes fails here, not at 10 min.
        with trio.fail_after(300):
            async with trio.open_nursery() as nursery:
                for fn in (hang_up, give_up, unary, stream, chat):
                    nursery.start_soon(fn)
        cl.close()

    trace = load_trace(path)
    assert trace.header.model == "smollm2"
    assert trace.header.engine["model_sha256"] == model_sha256("smollm2") is not None
    bodies = {r.body.get("prompt", "chat"): r for r in trace.requests}
    assert len(bodies) == 5
    hang, giveup = bodies["List the planets:"], bodies["Write a long poem about the sea."]
    assert hang.client.hangup_at_step is not None
    assert giveup.client.hangup_at_step is not None
    e = lines(trace)
    # Exact facts against what the clients received.
    u = e[bodies["The capital of France is"].id]
    assert (u["text"], u["completion_tokens"]) == (got["unary"].choices[0].text, 12)
    s = e[bodies["Once upon a time"].id]
    assert s["text"] == "".join(c.choices[0].text for c in got["stream"] if c.choices)
    assert s["frames"] == len(got["stream"])
    c = e[bodies["chat"].id]
    assert c["text"] == got["chat"].choices[0].message.content
    assert c["completion_tokens"] == got["chat"].usage.completion_tokens
    h = e[hang.id]
    assert h["aborted"]
    assert h["hangup_step"] == hang.client.hangup_at_step
    assert h["frames"] >= 3
    assert h["text"].startswith(stream_text(got["hang"]))
    assert h["last_step"] <= h["hangup_step"] < h["last_step"] + 2
    g = e[giveup.id]
    assert "status" not in g
    assert g["aborted"]
    assert g["frames"] == 0
    assert g["text"] == ""
    assert g["completion_tokens"] >= 3
    assert g["last_step"] == g["hangup_step"]
    assert e["end"]["free_blocks"] == 256

    result = await replay_in_thread(path, model=smollm2_model, tokenizer=smollm2_tokenizer)
    assert result.mismatches == ()
    assert result.expectations_checked
    for r in result.outcome.requests:  # the same tokens, step for step
        assert r.fields()["token_ids"] == e[r.id]["token_ids"]
        assert r.last_step == e[r.id]["last_step"]


async def test_redacted_prompts_keep_their_token_counts(tmp_path: Path) -> None:
    from support.http_harness import stub_parts

    tok = stub_parts()[1]
    path = tmp_path / "redacted.jsonl"
    system = {"role": "system", "content": "You are terse, and never say the word blue."}
    sent = [
        ("/v1/completions", {"model": "stub", "prompt": "The capital of France is",
                             "max_tokens": 3}),
        ("/v1/completions", {"model": "stub", "prompt": [1, 700, 3300, 28], "max_tokens": 3}),
        ("/v1/chat/completions", {"model": "stub", "max_tokens": 3, "messages": [
            system, {"role": "user", "content": "Name a color."}]}),
        ("/v1/chat/completions", {"model": "stub", "max_tokens": 3, "messages": [
            system, {"role": "user", "content": "Name a fruit, in 日本語."}]}),
    ]
    async with recorded(make_engine(), LiveClock(), path, redact=True) as (addr, _, _):
        for p, body in sent:
            await (await Raw.post(addr, body, path=p)).read_all()
    trace = load_trace(path)
    assert trace.expectations == ()
    assert "redacted" in (trace.header.note or "")
    text, ids, chat1, chat2 = (r.body for r in trace.requests)
    assert text["prompt"] != sent[0][1]["prompt"]
    assert len(tok.encode(text["prompt"])) == len(tok.encode("The capital of France is"))
    assert len(ids["prompt"]) == 4
    assert ids["prompt"] != [1, 700, 3300, 28]
    assert chat1["messages"][0] == chat2["messages"][0]  # equal contents stay equal
    assert chat1["messages"][0]["content"] != system["content"]
    for (_, original), redacted in zip(sent[2:], (chat1, chat2), strict=True):
        assert [m["role"] for m in redacted["messages"]] == ["system", "user"]
        assert all(a["content"] != b["content"] for a, b in zip(
            original["messages"], redacted["messages"], strict=True))
        assert len(tok.encode(tok.apply_chat_template(redacted["messages"]))) == len(
            tok.encode(tok.apply_chat_template(original["messages"])))
    assert (await replay_in_thread(path)).mismatches == ()


async def test_sigint_flushes_a_complete_trace(tmp_path: Path) -> None:
    """`nanoserve serve --record` as a process: one request done, one stream still running
    when SIGINT comes; the shutdown grace ends it, and the trace on disk is complete: the
    cut stream is a hang-up at the boundary where the server ended it, and it replays."""
    import signal
    import subprocess
    import sys

    from support.server_harness import keep_reading, read_until_ready

    path = tmp_path / "served.jsonl"
    cmd = [sys.executable, "-m", "nanoserve.cli", "serve", "--model", "stub", "--port", "0",
           "--num-blocks", "256", "--max-model-len", "4096", "--shutdown-grace", "0",
           "--record", str(path)]
    log: list[str] = []
    with trio.fail_after(120):  # a bound on a hang, not a timing assertion
        async with trio.open_nursery() as nursery:
            proc: Any = await nursery.start(partial(
                trio.run_process, cmd, stderr=subprocess.PIPE, check=False))
            addr = (await read_until_ready(proc.stderr, log)).removeprefix("http://")
            nursery.start_soon(keep_reading, proc.stderr, log)
            done = await Raw.post(addr, {"model": "stub", "prompt": PROMPT, "max_tokens": 5})
            await done.read_all()
            cut = await Raw.post(addr, {"model": "stub", "prompt": "The quick", "seed": 4,
                                        "max_tokens": 3000, "ignore_eos": True, "stream": True})
            await cut.read_frames(1)
            proc.send_signal(signal.SIGINT)
            await cut.read_all()
        assert proc.returncode == 0, "\n".join(log)
    assert json.loads(cut.events()[-2])["error"]["code"] == "shutting_down"
    trace = load_trace(path)
    r1, r2 = trace.requests
    assert r1.client.hangup_at_step is None
    assert r2.client.hangup_at_step is not None
    assert [e.id for e in trace.expectations] == ["r1", "end"]  # the cut one has none
    assert lines(trace)["r1"]["completion_tokens"] == 5
    assert "ended by the server's shutdown" in (trace.header.note or "")
    assert (await replay_in_thread(path)).mismatches == ()


def test_the_loader_checks_a_recorded_reading_pattern() -> None:
    from sim.trace.loader import TraceError, loads_trace
    from sim.trace.write import dumps_trace

    head = ('{"nanoserve_trace": 1, "clock": "step", "model": "stub", "engine": {"block_size":'
            ' 16, "num_blocks": 8, "max_num_seqs": 2, "max_num_batched_tokens": 64, "seed": 0}}')

    def line(read: Any) -> str:
        return head + "\n" + json.dumps({"id": "r1", "at_step": 0, "path": "/v1/completions",
                                         "body": {}, "client": {"read": read}})

    good = loads_trace(line({"frames_by_step": [[1, 1], [3, 4], [5, 4]]}))
    assert good.requests[0].client.read == FramesByStep(((1, 1), (3, 4), (5, 4)))
    assert loads_trace(dumps_trace(good)) == good  # the writer round-trips it
    for bad, why in [([], "non-empty"), ([[1, 2], [1, 3]], "steps must increase"),
                     ([[1, 2], [2, 1]], "never decrease"), ([[1, -1]], "integers >= 0"),
                     ([[1]], "[step, frames]")]:
        with pytest.raises(TraceError, match=r'line 2: field "client.read.frames_by_step": .*'
                           + why.replace("[", r"\[").replace("]", r"\]")):
            loads_trace(line({"frames_by_step": bad}))


# ------------------------------------------------------------ speculative decoding

SPEC_SOURCE = '{"name": "nanoserve", "version": 3, "license": "MIT"}'
SPEC_EDIT = SPEC_SOURCE.replace('"version": 3', '"version": 4')
SPEC_COPY = f"⟪say⟫{SPEC_EDIT}⟪/say⟫ Rewrite this JSON with version 4: {SPEC_SOURCE}\n"
SPEC_NGRAM = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4)


async def test_a_speculative_trace_replays_to_its_digest(tmp_path: Path) -> None:
    gate, path = GateClock(), tmp_path / "spec.jsonl"
    async with recorded(make_engine(speculative=SPEC_NGRAM), gate, path) as (addr, _, _):
        a = await Raw.post(addr, {"model": "stub", "prompt": SPEC_COPY, "max_tokens": 60,
                                  "temperature": 0, "stream": True})
        await settle()
        b = await Raw.post(addr, {"model": "stub", "prompt": SPEC_COPY * 2, "max_tokens": 40,
                                  "temperature": 1, "seed": 5})
        await settle()
        gate.release(60)
        await a.read_all()
        await b.read_all()
        await settle()
    trace = load_trace(path)
    assert trace.header.engine["speculative_config"] == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4, "disable_by_batch_size": 4, "adaptive": True}
    e = lines(trace)
    # 21 tokens (the edited object, then EOS) in 8 steps, as in tests/test_speculative.py;
    # the stream's frames are its steps, not its tokens.
    assert (e["r1"]["completion_tokens"], e["r1"]["first_token_step"], e["r1"]["last_step"],
            e["r1"]["frames"]) == (21, 1, 8, 8)
    first = await replay_in_thread(path)
    assert first.mismatches == ()
    again = await replay_in_thread(path)
    assert again.digest == first.digest
