"""The HTTP side of `sim bench`: send requests on a schedule, time every chunk.

It speaks plain OpenAI-compatible HTTP (httpx on Trio, through anyio), so it measures any
server that does: nanoserve, vLLM, Hugging Face's `transformers serve`. Two schedules:

- open loop: request i is sent at `at_s` seconds after the start, whether or not earlier
  ones have finished (arrivals from a synthetic load or a trace), as clients in the wild do;
- closed loop: N workers, each sending its next request when its last one finishes, so N
  requests are always in flight (`--concurrency N`); arrival times are ignored.

Times come from `now` (Trio's clock by default, which is monotonic) and are measured as
bytes arrive: a content chunk is stamped when the event that carries it is complete, before
the next read. Token counts come from the server's `usage` (streams ask for it with
`stream_options.include_usage`); a server that sends none is counted one token per content
chunk, and the record says which (`tokens_from`).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import trio

from sim.bench.records import RequestRecord
from sim.http.sse import Chunk, SseParser, read_chunk

Now = Callable[[], float]


@dataclass(frozen=True, slots=True)
class BenchRequest:
    id: str
    path: str  # /v1/completions or /v1/chat/completions
    body: dict[str, Any]
    at_s: float = 0.0  # open-loop send time, seconds after the start
    hangup_after_frames: int | None = None  # close the stream after this many frames


def prepare_body(
    body: Mapping[str, Any], *, model: str, stream: bool, extra: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The body as sent: the served model's name, the streaming choice (with usage asked
    for), then `extra` merged on top, where a None value removes the key (e.g. a peer that
    rejects vLLM's `ignore_eos`)."""
    out = copy.deepcopy(dict(body))
    out["model"] = model
    out["stream"] = stream
    if stream:
        out["stream_options"] = {"include_usage": True}
    else:
        out.pop("stream_options", None)
    for key, value in (extra or {}).items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def make_client(concurrency: int | None = None) -> httpx.AsyncClient:
    # No read timeout: a long stream under heavy load is a slow request, which is the
    # measurement, not a failure. No pool limit below the load's own concurrency.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=concurrency)
    return httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits)


async def served_model(client: httpx.AsyncClient, url: str) -> str:
    """The first model id of GET /v1/models: what the server answers to."""
    r = await client.get(f"{url}/v1/models")
    if r.status_code != 200:
        raise ValueError(f"{url}/v1/models answered {r.status_code}; give --model")
    data = r.json().get("data") or []
    if not data:
        raise ValueError(f"{url}/v1/models lists no model; give --model")
    return str(data[0]["id"])


async def send_one(
    client: httpx.AsyncClient, url: str, req: BenchRequest, t0: float, now: Now
) -> RequestRecord:
    """Send one request and time it; every failure becomes the record's `error`."""
    sent = now()
    rec = RequestRecord(req.id, sent_s=sent - t0)
    try:
        async with client.stream("POST", url + req.path, json=req.body) as resp:
            rec.status = resp.status_code
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", errors="replace")
                rec.error = f"HTTP {resp.status_code}: {body[:300]}"
            elif req.body.get("stream"):
                await _read_stream(resp, req, rec, sent, now)
            else:
                _read_unary((await resp.aread()), rec)
    except httpx.HTTPError as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    rec.e2e_s = now() - sent
    rec.ok = rec.error is None and not rec.hung_up
    return rec


async def _read_stream(
    resp: httpx.Response, req: BenchRequest, rec: RequestRecord, sent: float, now: Now
) -> None:
    parser = SseParser()
    frames = 0
    last = sent
    finished = done = False
    async for data in resp.aiter_bytes():
        for event in parser.feed(data):
            chunk = read_chunk(event)
            if chunk.done:
                done = True
                break
            frames += 1
            last = _take(chunk, rec, sent, last, now)
            finished = finished or chunk.finish_reason is not None
            if req.hangup_after_frames is not None and frames >= req.hangup_after_frames:
                rec.hung_up = True
                return  # leaving the `stream` block closes the connection: a hang-up
        if done:
            break
    for event in [] if done else parser.close():
        chunk = read_chunk(event)
        done = done or chunk.done
        if not chunk.done:
            last = _take(chunk, rec, sent, last, now)
            finished = finished or chunk.finish_reason is not None
    if rec.error is None and not (finished or done):
        rec.error = "the stream ended without a finish_reason or [DONE]"


def _take(chunk: Chunk, rec: RequestRecord, sent: float, last: float, now: Now) -> float:
    """Fold one frame into the record; returns the time of the latest content chunk."""
    if chunk.error is not None:
        rec.error = rec.error or chunk.error
    if chunk.usage is not None:
        _usage(chunk.usage, rec)
    if not chunk.has_content:
        return last
    t = now()
    if rec.chunks == 0:
        rec.ttft_s = t - sent
    else:
        rec.itl_s.append(t - last)
    rec.chunks += 1
    if rec.tokens_from == "chunks":
        rec.output_tokens = rec.chunks
    return t


def _usage(usage: Mapping[str, Any], rec: RequestRecord) -> None:
    completion = usage.get("completion_tokens")
    if isinstance(completion, int):
        rec.output_tokens = completion
        rec.tokens_from = "usage"
    prompt = usage.get("prompt_tokens")
    if isinstance(prompt, int):
        rec.prompt_tokens = prompt


def _read_unary(body: bytes, rec: RequestRecord) -> None:
    try:
        obj = json.loads(body)
    except ValueError:
        rec.error = f"not JSON: {body[:200]!r}"
        return
    if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
        _usage(obj["usage"], rec)
    else:
        rec.error = "a unary response without usage"


async def run_load(
    url: str,
    requests: Sequence[BenchRequest],
    *,
    concurrency: int | None = None,
    client: httpx.AsyncClient | None = None,
    now: Now = trio.current_time,
) -> tuple[list[RequestRecord], float]:
    """Send every request (open loop by `at_s`, or closed loop at `concurrency`); return
    the records in request order and the duration (first send to last finish)."""
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    own = client is None
    cl = client or make_client(concurrency)
    records: list[RequestRecord | None] = [None] * len(requests)
    try:
        t0 = now()

        async def one(i: int) -> None:
            records[i] = await send_one(cl, url, requests[i], t0, now)

        async with trio.open_nursery() as nursery:
            if concurrency is None:
                for i, req in enumerate(requests):
                    await trio.sleep_until(t0 + req.at_s)
                    nursery.start_soon(one, i)
            else:
                send, receive = trio.open_memory_channel[int](len(requests))
                for i in range(len(requests)):
                    send.send_nowait(i)
                send.close()
                async with receive:  # each worker holds a clone; the last to finish closes
                    for _ in range(min(concurrency, len(requests))):
                        nursery.start_soon(_worker, receive.clone(), one)
        done = [r for r in records if r is not None]
        end = max((r.sent_s + (r.e2e_s or 0.0) for r in done), default=0.0)
        start = min((r.sent_s for r in done), default=0.0)
        return done, end - start
    finally:
        if own:
            await cl.aclose()


async def _worker(
    receive: trio.MemoryReceiveChannel[int], one: Callable[[int], Any]
) -> None:
    async with receive:
        async for i in receive:
            await one(i)
