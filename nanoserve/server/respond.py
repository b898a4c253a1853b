"""From a job to an HTTP answer: a unary JSON body, or an SSE stream.

The status is chosen before the first byte (docs/ARCHITECTURE.md). Validation has already run by the
time a job exists; here the handler also waits for the job's *first* update before it
commits to a status, so an error that comes with the first update (the engine failed, the
server is shutting down) is still a proper 5xx. After that the status is sent, and a failure
becomes `data: {"error": {...}}` then `data: [DONE]`.

One SSE frame goes out per update that has text or a finish, never merging queued updates,
so a trace's `hangup_after_frames` counts the same frames in every replay. An update whose
text is held back (a multi-byte character, a possible stop string, a tool call's markup
forming) sends nothing; its token's logprobs ride on the next frame of that choice.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

import trio
from quart import Response, current_app
from quart.wrappers.response import ResponseBody

from nanoserve.engine.admission import Prepared
from nanoserve.server import recording
from nanoserve.server.body.parse import StreamUsage
from nanoserve.server.errors import ApiError
from nanoserve.server.jobs import Ended, Item, Job, Registry
from nanoserve.server.render import Choice, Json, Shapes
from nanoserve.server.render import usage as usage_of

DONE = b"data: [DONE]\n\n"


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    body = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    resp: Response = current_app.response_class(
        body, status=status, content_type="application/json", headers=headers or {}
    )
    return resp


def frame(obj: Json) -> bytes:
    data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return b"data: " + data.encode() + b"\n\n"


def failure(item: Item) -> ApiError | None:
    """The error an item stands for, if any: an outside end, an engine error, or an abort
    the client did not ask for (a client that hangs up is not reading any more)."""
    if isinstance(item, Ended):
        return ApiError(item.status, item.message, None, item.code)
    _, u = item
    if u.error_param is not None:  # the request's own fault, found only while generating
        return ApiError(400, u.error or "the request cannot be completed", u.error_param,
                        "invalid_value")
    if u.finish_reason == "error" or (u.error is not None and u.finish_reason != "abort"):
        return ApiError(500, u.error or "the request failed in the engine", None, "engine_error")
    if u.finish_reason == "abort":
        return ApiError(503, u.error or "the request was aborted by the server", None,
                        "aborted")
    return None


async def respond(
    registry: Registry,
    nursery: trio.Nursery,
    prepared: Sequence[Prepared],
    shapes: Shapes,
    prefixes: Sequence[str] | None,  # the echoed prompts, one per prompt; None: no echo
    *,
    stream: bool,
    usage: StreamUsage,
    headers: dict[str, str],
) -> Response:
    job = registry.open(shapes.id, prepared, nursery)
    recording.link(job)  # serve --record: which engine requests this exchange became
    try:
        first = await job.next()
        err = failure(first)
        if err is not None:
            raise err
    except BaseException:  # a client gone before the first token is a stopped request too
        job.close()
        raise
    choices = [
        Choice(i, prefix=prefixes[i // job.n] if prefixes else "",
               prompt_ids=tuple(prepared[i // job.n].prompt_ids), echo=prefixes is not None)
        for i in range(len(prepared) * job.n)
    ]
    if stream:
        body = SseBody(job, _sse(job, shapes, choices, first, usage))
        resp: Response = current_app.response_class(
            body, status=200, content_type="text/event-stream",
            headers={**headers, "Cache-Control": "no-cache"},
        )
        resp.timeout = None  # Quart's RESPONSE_TIMEOUT would cut a long stream silently
        return resp
    try:
        return json_response(await _collect(job, shapes, choices, first), headers=headers)
    finally:
        job.close()


class SseBody(ResponseBody):
    """A stream's body. Every way out of it closes the job: the generator's `finally` (the
    end, or a hang-up while it runs), `__aexit__` (Quart leaving the body), and
    `close_nowait`, which the app's connection class calls once sending has ended, for the
    one way out neither covers: a hang-up while Quart is still sending the status line,
    before it has entered the body at all (an unstarted generator's `finally` never runs)."""

    def __init__(self, job: Job, frames: AsyncGenerator[bytes, None]) -> None:
        self.job = job
        self._frames = frames

    async def __aenter__(self) -> SseBody:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.job.close()  # first: the await below may be cancelled
        await self._frames.aclose()

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._frames

    def close_nowait(self) -> None:
        self.job.close()


async def _collect(job: Job, shapes: Shapes, choices: list[Choice], item: Item) -> Json:
    while True:
        err = failure(item)
        if err is not None:
            raise err
        assert not isinstance(item, Ended)
        k, u = item
        choices[k * job.n + u.index].add(u)
        if job.done:
            return shapes.response(choices, usage_of(job.num_prompt_tokens,
                                                     job.num_output_tokens))
        item = await job.next()


async def _sse(
    job: Job, shapes: Shapes, choices: list[Choice], item: Item, usage: StreamUsage
) -> AsyncGenerator[bytes, None]:
    # `finally` runs on every way out: the end, a hang-up while waiting (trio.Cancelled) or
    # while paused at a yield (GeneratorExit via aclose); `job.close` is synchronous.
    try:
        while True:
            err = failure(item)
            if err is not None:
                yield frame(err.body())
                break
            assert not isinstance(item, Ended)
            k, u = item
            c = choices[k * job.n + u.index]
            if c.add(u) and (chunk := shapes.chunk(c, u.text)) is not None:
                if usage.every_chunk:  # vLLM's: this choice's prompt and its tokens so far
                    chunk["usage"] = usage_of(len(c.prompt_ids), len(c.token_ids))
                elif usage.at_end:
                    chunk["usage"] = None  # as OpenAI: present, null, until the last chunk
                yield frame(chunk)
            if job.done:
                if usage.at_end:
                    total = usage_of(job.num_prompt_tokens, job.num_output_tokens)
                    yield frame(shapes.usage_chunk(total))
                break
            item = await job.next()
        yield DONE
    finally:
        job.close()
