"""Raw HTTP/1.1 clients for `sim soak`: one TCP connection per request, cut at an exact point.

A high-level client (httpx, openai) reads ahead into its own buffers and hides when bytes
arrive; the soak needs clients that close the socket after exactly k SSE frames, that read
256 bytes at a time through a small receive buffer so the server's send buffer fills, or
that never read a byte. So each client is a Trio socket, with h11 (Hypercorn's own HTTP/1.1
machine, already installed with it) doing the framing, chunked encoding included, and
`sim.http.sse.SseParser` splitting the events.

Every request says `Connection: close`: one request per connection, so a hang-up is the end
of that socket and nothing else, and Hypercorn never waits out a keep-alive on shutdown.

The second half plays a `ClientPlan` (sim.soak.plan). A hang-up is timed against the
server's own progress: `Progress`, fed by the bridge's step listener, counts the tokens each
engine request has produced, and a `before_headers` or `give_up` client closes its socket
once its request has the planned number. The soak runs the server in-process, which is what
makes this possible, and it is what makes every hang-up land while the server holds the
request (never before the request has arrived), so the bridge's `aborted` count is exact.
"""

from __future__ import annotations

import json
import socket
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import h11
import trio

from nanoserve.engine.outputs import StepResult
from sim.http.sse import DONE, SseParser
from sim.soak.plan import ClientPlan

EAGER_READ = 65536
SLOW_RCVBUF = 4096  # bytes; the kernel doubles it
SLOW_READ = 256  # bytes per read
SLOW_PAUSE_S = 0.02  # between reads: ~12 KiB/s, slower than the stub writes a long stream


@dataclass(slots=True)
class Reply:
    """What one client saw of its response."""

    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)  # names lowercased
    body: bytearray = field(default_factory=bytearray)  # the raw body (SSE bytes for a stream)
    events: list[str] = field(default_factory=list)  # SSE `data:` payloads, [DONE] included
    complete: bool = False  # the whole response arrived
    bytes_read: int = 0  # from the socket, headers included

    @property
    def done(self) -> bool:
        """A stream's terminator arrived (a unary response has none)."""
        return bool(self.events) and self.events[-1] == DONE

    def json(self) -> Any:
        return json.loads(self.body)


class Connection:
    """One request on one fresh connection; close it to hang up."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self._stream = stream
        self._h11 = h11.Connection(h11.CLIENT)
        self._sse = SseParser()
        self.reply = Reply()

    @classmethod
    async def open(cls, url: str, *, rcvbuf: int | None = None) -> Connection:
        """Connect to `url` (http://host:port). `rcvbuf` shrinks the socket's receive
        buffer before connecting (the window is negotiated at the handshake), so a slow
        reader's unread bytes back up into the server's send buffer quickly."""
        parts = urlsplit(url)
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            if rcvbuf is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            await sock.connect((parts.hostname or "127.0.0.1", parts.port or 80))
        except BaseException:
            sock.close()
            raise
        return cls(trio.SocketStream(sock))

    async def send(self, method: str, path: str, body: Any = None,
                   headers: dict[str, str] | None = None) -> None:
        raw = b"" if body is None else json.dumps(body, ensure_ascii=False).encode()
        hdrs = [("Host", "soak"), ("Connection", "close"), ("Content-Length", str(len(raw)))]
        if body is not None:
            hdrs.append(("Content-Type", "application/json"))
        hdrs += list((headers or {}).items())
        out = self._h11.send(h11.Request(method=method, target=path, headers=hdrs))
        out = (out or b"") + (self._h11.send(h11.Data(data=raw)) or b"")
        out += self._h11.send(h11.EndOfMessage()) or b""
        await self._stream.send_all(out)

    async def read(self, *, max_bytes: int = EAGER_READ, pause: float = 0.0,
                   until_events: int | None = None) -> Reply:
        """Read until the response ends, or until `until_events` SSE events have arrived;
        `max_bytes` per socket read, with `pause` seconds between reads (a slow reader)."""
        r = self.reply
        while not r.complete and (until_events is None or len(r.events) < until_events):
            event = self._h11.next_event()
            if event is h11.NEED_DATA:
                if pause and r.bytes_read:
                    await trio.sleep(pause)
                chunk = await self._stream.receive_some(max_bytes)
                r.bytes_read += len(chunk)
                self._h11.receive_data(chunk)  # b"" is EOF: h11 then raises if cut short
            elif isinstance(event, h11.Response):
                r.status = event.status_code
                r.headers = {k.decode().lower(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                r.body += event.data
                if r.headers.get("content-type", "").startswith("text/event-stream"):
                    r.events += self._sse.feed(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                r.complete = True
            elif isinstance(event, h11.ConnectionClosed):
                raise h11.RemoteProtocolError("the server closed the connection mid-response")
        return r

    async def aclose(self) -> None:
        """Close the socket: a hang-up unless the response is complete."""
        await self._stream.aclose()


async def request(url: str, method: str, path: str, body: Any = None,
                  headers: dict[str, str] | None = None) -> Reply:
    """One whole exchange, read eagerly."""
    conn = await Connection.open(url)
    try:
        await conn.send(method, path, body, headers)
        return await conn.read()
    finally:
        await conn.aclose()


# -- the soak's clients ---------------------------------------------------------------------


@dataclass(slots=True)
class Outcome:
    plan: ClientPlan
    reply: Reply
    hung_up: bool = False  # closed its socket before the whole response had arrived
    # Slow readers: SSE frames not yet read when the engine finished the request (the
    # server held them, in its queues and socket buffers, and went on with the batch).
    unread_at_end: int | None = None
    error: str | None = None  # what went wrong on the client's side


class Progress:
    """Tokens produced per engine request, fed by the bridge's step listener (in the loop
    task, between steps): lets a client hang up at a point in its request's progress. An
    abort ends a request at a boundary, not in a step, so it never shows here; a request
    that shows as finished here ran to its own end (length, stop)."""

    def __init__(self) -> None:
        self.steps = 0
        self._tokens: Counter[str] = Counter()
        self.finish_reasons: dict[str, str | None] = {}  # requests a step has ended
        self._finished: set[str] = set()
        self._waiters: dict[str, list[tuple[int, trio.Event]]] = {}
        self._stepped = trio.Event()

    def on_step(self, result: StepResult) -> None:
        self.steps += 1
        self._stepped.set()
        self._stepped = trio.Event()
        for u in result.updates:
            self._tokens[u.request_id] += len(u.new_token_ids)
            if u.finished:
                self._finished.add(u.request_id)
                self.finish_reasons[u.request_id] = u.finish_reason
            for need, event in self._waiters.get(u.request_id, []):
                if self._reached(u.request_id, need):
                    event.set()

    def _reached(self, rid: str, need: int) -> bool:
        """`need` tokens produced, or a completion of the request finished (need=0 waits for
        that alone): a client never waits for tokens that will not come."""
        return rid in self._finished or (need > 0 and self._tokens[rid] >= need)

    async def wait(self, rid: str, need: int) -> None:
        if not self._reached(rid, need):
            event = trio.Event()
            self._waiters.setdefault(rid, []).append((need, event))
            await event.wait()

    async def wait_steps(self, steps: int) -> None:
        """Until `steps` steps have run in all."""
        while self.steps < steps:
            await self._stepped.wait()


async def run_client(url: str, plan: ClientPlan, progress: Progress) -> Outcome:
    slow = plan.role == "slow"
    out = Outcome(plan, Reply())
    try:
        conn = await Connection.open(url, rcvbuf=SLOW_RCVBUF if slow else None)
        out.reply = conn.reply
        try:
            await conn.send("POST", plan.path, plan.body, {"X-Request-Id": plan.request_id})
            await _behave(conn, plan, progress, out)
        finally:
            out.hung_up = not conn.reply.complete
            await conn.aclose()
    except (OSError, trio.BrokenResourceError, h11.ProtocolError) as exc:
        out.error = repr(exc)
    return out


async def _behave(conn: Connection, plan: ClientPlan, progress: Progress, out: Outcome) -> None:
    if plan.hangup == "mid_stream":
        await conn.read(until_events=plan.at)
    elif plan.hangup is not None:  # before_headers, give_up: hang up at a token count
        async with trio.open_nursery() as nursery:
            if plan.hangup == "give_up":  # waits for its unary answer meanwhile

                async def read_all() -> None:
                    await conn.read()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(read_all)
            await progress.wait(plan.engine_id, plan.at)
            nursery.cancel_scope.cancel()
    elif plan.role == "slow":
        async with trio.open_nursery() as nursery:

            async def note_end() -> None:
                await progress.wait(plan.engine_id, 0)
                out.unread_at_end = len(conn.reply.events)

            nursery.start_soon(note_end)
            await conn.read(max_bytes=SLOW_READ, pause=SLOW_PAUSE_S)
            if out.unread_at_end is not None:
                out.unread_at_end = len(conn.reply.events) - out.unread_at_end
            nursery.cancel_scope.cancel()
    else:
        await conn.read(max_bytes=EAGER_READ)


async def run_all(url: str, plans: list[ClientPlan], progress: Progress) -> list[Outcome]:
    outcomes: list[Outcome | None] = [None] * len(plans)

    async def one(k: int) -> None:
        outcomes[k] = await run_client(url, plans[k], progress)

    async with trio.open_nursery() as nursery:
        for k in range(len(plans)):
            nursery.start_soon(one, k)
    return [o for o in outcomes if o is not None]
