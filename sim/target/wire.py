"""One exchange with a server we do not control, kept as its client saw it.

Everything the checks judge comes from here: the status, the headers, the unary body or the
stream's frames (each with its arrival time), whether the connection dropped, and whether
we hung up. Nothing is interpreted on the way in, so a check can show the evidence as it
arrived. The stream is read with the project's SSE parser (sim/http/sse.py), which takes the
SSE rules from the spec, not from any one server: a line that is not UTF-8 decodes with
U+FFFD, and a check sees the U+FFFD.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

from sim.http.sse import DONE, SseParser


@dataclass(frozen=True, slots=True)
class Frame:
    data: str  # the event's data as it arrived (decoded as UTF-8, U+FFFD where it was not)
    obj: dict[str, Any] | None  # its JSON object; None for [DONE] or data that is not one
    t: float  # seconds from sending the request to this frame


@dataclass(slots=True)
class Seen:
    """What a client saw of one request."""

    path: str
    body: Any  # the body sent (bytes where they were sent as they are)
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    json: Any = None  # a unary answer's JSON (or an error's); None where it was not JSON
    raw: bytes = b""  # a unary answer's bytes
    frames: list[Frame] = field(default_factory=list)
    done: bool = False  # the stream ended with [DONE]
    dropped: str | None = None  # the connection failed: how
    hung_up: bool = False  # we closed the stream before its end
    seconds: float = 0.0

    @property
    def stream(self) -> bool:
        return isinstance(self.body, dict) and self.body.get("stream") is True

    def evidence(self) -> dict[str, Any]:
        """The request and what came back, short enough for a report."""
        out: dict[str, Any] = {"path": self.path, "status": self.status}
        out["body"] = (self.body if isinstance(self.body, dict)
                       else self.body.decode("utf-8", "replace")[:300])
        if self.dropped:
            out["dropped"] = self.dropped
        if self.frames:
            out["frames"] = [f.data[:300] for f in self.frames[:40]]
        elif self.raw:
            out["answer"] = self.raw[:600].decode("utf-8", "replace")
        return out


def make_client(api_key: str | None = None) -> httpx.AsyncClient:
    """The checks' client: `api_key` goes as `Authorization: Bearer` on every request."""
    # A check may wait on a slow server; a dropped connection is the finding, so no retries.
    return httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=10.0),
                             limits=httpx.Limits(max_connections=None),
                             headers=auth_headers(api_key))


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


async def send(client: httpx.AsyncClient, url: str, path: str, body: Mapping[str, Any] | bytes,
               *, hangup_after_frames: int | None = None, pause_s: float = 0.0,
               not_before: Callable[[int], float] | None = None,
               headers: Mapping[str, str] | None = None) -> Seen:
    """POST `body` (JSON, or bytes as they are) and read the answer as a client would:
    all of it, or, for a stream, until `hangup_after_frames` frames (then close). `pause_s`:
    seconds to wait after each frame, a slow reader's pace; `not_before(k)`: the (Trio) time
    before which the client does not take frame k + 1, a recorded reader's pace."""
    seen = Seen(path, dict(body) if isinstance(body, Mapping) else body)
    start = trio.current_time()
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    hdrs = {"content-type": "application/json", **(headers or {})}
    try:
        async with client.stream("POST", url + path, content=content, headers=hdrs) as resp:
            seen.status = resp.status_code
            seen.headers = {k.lower(): v for k, v in resp.headers.items()}
            if resp.headers.get("content-type", "").startswith("text/event-stream"):
                await _read_frames(resp, seen, start, hangup_after_frames, pause_s,
                                   not_before)
            else:
                seen.raw = await resp.aread()
                seen.json = parse_json(seen.raw)
    except httpx.HTTPError as exc:
        seen.dropped = f"{type(exc).__name__}: {exc}"
    seen.seconds = trio.current_time() - start
    return seen


async def get(client: httpx.AsyncClient, url: str, path: str) -> tuple[int | None, Any, str]:
    """GET `path`: its status (None where the connection failed), JSON (or None) and text."""
    try:
        r = await client.get(url + path)
    except httpx.HTTPError as exc:
        return None, None, f"{type(exc).__name__}: {exc}"
    return r.status_code, parse_json(r.content), r.text


async def _read_frames(resp: httpx.Response, seen: Seen, start: float,
                       hangup_after: int | None, pause_s: float,
                       not_before: Callable[[int], float] | None) -> None:
    parser = SseParser()
    if hangup_after == 0:  # gone once the headers came: leaving the block closes it
        seen.hung_up = True
        return
    async for data in resp.aiter_bytes():
        for event in parser.feed(data):
            if _take(seen, event, start):
                return
            if hangup_after is not None and len(seen.frames) >= hangup_after:
                seen.hung_up = True
                return  # leaving the `stream` block closes the connection: a hang-up
            if pause_s:
                await trio.sleep(pause_s)
            if not_before is not None:
                await trio.sleep_until(not_before(len(seen.frames)))
    for event in parser.close():
        if _take(seen, event, start):
            return


def _take(seen: Seen, event: str, start: float) -> bool:
    """Keep one event; True at [DONE]."""
    if event.strip() == DONE:
        seen.done = True
        return True
    obj = parse_json(event.encode())
    seen.frames.append(Frame(event, obj if isinstance(obj, dict) else None,
                             trio.current_time() - start))
    return False


def first_model(raw: bytes) -> str | None:
    """The first model id of a /v1/models answer; None where there is none."""
    obj = parse_json(raw)
    data = obj.get("data") if isinstance(obj, dict) else None
    first = data[0] if isinstance(data, list) and data else None
    model = first.get("id") if isinstance(first, dict) else None
    return str(model) if model is not None else None


def parse_json(raw: bytes) -> Any:
    """The JSON `raw` holds, or None."""
    try:
        return json.loads(raw)
    except ValueError:
        return None
