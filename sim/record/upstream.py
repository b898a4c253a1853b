"""`sim record --upstream URL --out TRACE`: a recording proxy in front of any
OpenAI-compatible server.

Every request is forwarded as it came (method, path, query, headers but the hop-by-hop
ones, the body's bytes), and every answer as it comes: the upstream's raw bytes go to the
client chunk by chunk as they arrive (`aiter_raw`, so not even a gzip is undone), with no
buffering a client could notice. A client that hangs up closes the upstream stream at once,
so the upstream sees the hang-up too.

The generation routes are recorded as a virtual-clock trace (sim/trace/format.py), the
only clock a proxy can see:

- `at_s`: seconds from the first request's arrival to this one's;
- `client.hangup_after_frames`: the SSE frames the client had been sent when it left;
- `client.read: {"every_s": S}`: a slow reader, one whose socket took at least one frame
  more than `SLOW_S` late (the median interval between its frames);
- the expectation: what the client read, parsed as `serve --record` parses it (wire.py):
  the status, an error's code, each choice's text and finish_reason, a stream's frames, and
  the usage's completion_tokens where the upstream gave usage.

The header's engine settings are EngineConfig's defaults (or `--engine` overrides), since a
proxy cannot see the upstream's: a `sim replay` of the trace on nanoserve checks the texts,
and `sim replay --target` repeats the clients' behaviour at any server. As `serve --record`
does (sim/trace/journal.py), the file is a journal while the proxy runs, each exchange
appended as it ends, so a kill keeps every request that ended before it; a clean stop
(SIGINT or SIGTERM) rewrites it as the trace, in arrival order.
"""

from __future__ import annotations

import itertools
import logging
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

from sim.http import raw_asgi
from sim.http.raw_asgi import Receive, Send
from sim.http.sse import SseParser
from sim.record.trace import json_body
from sim.record.wire import parse_wire
from sim.target.wire import parse_json
from sim.trace.format import (
    PATHS,
    ClientSpec,
    EverySeconds,
    Expectation,
    Trace,
    TraceHeader,
    TraceRequest,
)
from sim.trace.journal import ORDER, JournalWriter
from sim.trace.write import dumps_line, expectation_object, request_object

# RFC 9110's connection-specific fields, and the framing each side sets for itself.
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer",
                        b"transfer-encoding", b"upgrade", b"host", b"content-length"})
log = logging.getLogger("sim.record")
SLOW_S = 0.05  # a send to the client that took this long means its socket was full


@dataclass
class Exchange:
    rid: str  # r1, r2, ... in arrival order
    at_s: float
    path: str
    body: bytes
    status: int | None = None
    chunks: list[bytes] = field(default_factory=list)
    frames: int = 0  # SSE frames the client was sent
    slow_gaps: list[float] = field(default_factory=list)  # sends that waited on the client
    frame_times: list[float] = field(default_factory=list)
    hung_up: bool = False
    complete: bool = False  # the client was sent the whole answer
    dropped: bool = False  # the upstream failed (a 502 of ours, or a cut mid-answer)


class Proxy:
    def __init__(self, upstream: str, client: httpx.AsyncClient,
                 journal: JournalWriter | None = None) -> None:
        """`journal`: where each exchange is appended as it ends (its header written
        already), so that a kill keeps every request that ended before it."""
        self.upstream = upstream.rstrip("/")
        self.client = client
        self.journal = journal
        self.exchanges: list[Exchange] = []
        self._t0: float | None = None
        self._ids = itertools.count(1)
        self.failed = False  # an exchange could not be written to the journal

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await raw_asgi.lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        now = trio.current_time()
        recorded = scope["method"] == "POST" and scope["path"] in PATHS
        if recorded and self._t0 is None:
            self._t0 = now  # seconds count from the first recorded arrival
        rid = f"r{next(self._ids)}" if recorded else ""
        ex = Exchange(rid, now - (self._t0 if self._t0 is not None else now), scope["path"],
                      b"")
        if recorded:
            self.exchanges.append(ex)  # now: its id and place are its arrival's
        ex.body, gone = await raw_asgi.read_body(receive)
        if gone:  # a body cut short: nothing a replay could send (serve --record's rule)
            if recorded:
                self.exchanges.remove(ex)
            return
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope, ex)
                await self._forward(scope, ex, send)
                nursery.cancel_scope.cancel()
        finally:
            if recorded and self.journal is not None:
                try:
                    self._journal(ex)
                except Exception:  # a recorder bug: this exchange is lost, say which
                    log.exception("sim record: %s (%s) could not be written", ex.rid, ex.path)
                    self.failed = True

    def _journal(self, ex: Exchange) -> None:
        """The exchange's request line (its place: its arrival) and expectation, appended."""
        assert self.journal is not None
        self.journal.write(dumps_line({**request_object(_request_line(ex)), ORDER: [ex.at_s]}))
        if (fields := _outcome(ex)) is not None:
            self.journal.write(dumps_line(expectation_object(Expectation(ex.rid, fields))))

    async def _forward(self, scope: dict[str, Any], ex: Exchange, send: Send) -> None:
        # The path as the client sent it (raw_path), not as the server decoded it.
        raw = scope.get("raw_path")
        url = self.upstream + (raw.decode("latin-1") if raw else scope["path"])
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in HOP_BY_HOP]
        req = self.client.build_request(scope["method"], url, headers=headers, content=ex.body)
        try:
            resp = await self.client.send(req, stream=True)
        except httpx.HTTPError as exc:
            ex.status, ex.dropped = 502, True
            await raw_asgi.respond(send, 502, b"text/plain; charset=utf-8", f"upstream "
                                   f"{self.upstream}: {type(exc).__name__}: {exc}".encode())
            return
        try:
            ex.status = resp.status_code
            await send({"type": "http.response.start", "status": resp.status_code,
                        "headers": [(k, v) for k, v in resp.headers.raw
                                    if k.lower() not in HOP_BY_HOP]})
            try:
                await self._relay(resp, ex, send)
                ex.complete = True
            except httpx.HTTPError:  # the upstream cut the answer: the client gets it cut
                ex.dropped = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await resp.aclose()

    async def _relay(self, resp: httpx.Response, ex: Exchange, send: Send) -> None:
        """The upstream's bytes to the client, chunk by chunk, noting frames and waits."""
        parser = SseParser()
        length = resp.headers.get("content-length", "")
        sent = 0
        async for chunk in resp.aiter_raw():
            events = parser.feed(chunk)
            # Complete before the send returns: a client that has all of it may close at
            # once, and that is no hang-up.
            sent += len(chunk)
            ex.complete = any(e.strip() == "[DONE]" for e in events) or (
                length.isdigit() and sent >= int(length))
            start = trio.current_time()
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            took = trio.current_time() - start
            ex.chunks.append(chunk)
            ex.frames += len(events)
            ex.frame_times.append(start)
            if took >= SLOW_S:
                ex.slow_gaps.append(took)

    def trace(self, model: str, engine: Mapping[str, Any], note: str) -> Trace:
        requests, expectations = [], []
        for ex in self.exchanges:  # in arrival order, as their ids
            requests.append(_request_line(ex))
            if (fields := _outcome(ex)) is not None:
                expectations.append(Expectation(ex.rid, fields))
        return Trace(TraceHeader("virtual", model, dict(engine), note=note),
                     tuple(requests), tuple(expectations))


def _outcome(ex: Exchange) -> dict[str, Any] | None:
    """The expectation's fields; None for a hang-up or an upstream that failed."""
    if ex.hung_up or ex.dropped or ex.status is None:
        return None
    return _expected(ex)


def _request_line(ex: Exchange) -> TraceRequest:
    rid = ex.rid
    obj, raw = json_body(ex.body)  # the bytes where strict JSON cannot hold the body
    client = ClientSpec(
        read=(EverySeconds(max(0.001, round(statistics.median(_intervals(ex)), 3)))
              if ex.slow_gaps else "eager"),
        hangup_after_frames=ex.frames if ex.hung_up else None)
    return TraceRequest(rid, ex.path, obj, client, at_s=round(ex.at_s, 4), raw_body=raw)


def _intervals(ex: Exchange) -> list[float]:
    gaps = [b - a for a, b in zip(ex.frame_times, ex.frame_times[1:], strict=False)]
    return gaps or [SLOW_S]


def _expected(ex: Exchange) -> dict[str, Any]:
    """What the client read (wire.py, as `serve --record` reads it): the status, an error's
    code, each choice's text and finish_reason, a stream's frames, and completion_tokens
    where the upstream gave usage."""
    raw = b"".join(ex.chunks)
    body = parse_json(ex.body)
    stream = isinstance(body, dict) and body.get("stream") is True
    wire = parse_wire(ex.status, raw, stream)
    fields: dict[str, Any] = {"status": ex.status}
    if wire.error is not None:
        fields["error"] = wire.error
    if ex.status != 200:
        return fields
    if len(wire.texts) > 1:
        fields["choices"] = [{"text": wire.text(i), "finish_reason": wire.finish_reason(i)}
                             for i in sorted(wire.texts)]
    else:
        fields.update(text=wire.text(0), finish_reason=wire.finish_reason(0))
    if wire.stream:
        fields["frames"] = wire.frames
    usage = _usage(raw, wire.stream)
    if isinstance(usage.get("completion_tokens"), int):
        fields["completion_tokens"] = usage["completion_tokens"]
    return fields


def _usage(raw: bytes, stream: bool) -> dict[str, Any]:
    """The answer's usage: the unary body's, or the last stream frame's that has one."""
    if not stream:
        obj = parse_json(raw)
        usage = obj.get("usage") if isinstance(obj, dict) else None
        return usage if isinstance(usage, dict) else {}
    parser = SseParser()
    for event in reversed(parser.feed(raw) + parser.close()):
        obj = parse_json(event.encode())
        if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
            return dict(obj["usage"])
    return {}


async def _cancel_on_disconnect(receive: Receive, scope: trio.CancelScope,
                                ex: Exchange) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    ex.hung_up = not ex.complete
    scope.cancel()
