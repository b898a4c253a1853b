"""`POST /v1/responses`: OpenAI's Responses API, stateless, on the chat machinery.

The body is translated into the chat-completions request it stands for (translate.py),
which is parsed, prepared and run exactly as `/v1/chat/completions` runs it: the same
template, tools, constraints and reasoning split (server/tools/). The choice's text is read
by the same `ChoiceOutput` and each delta rendered as Responses events
(events.py): an SSE stream of `event:`/`data:` frames, or, unary, the response
object those events build. One choice: the Responses API has no `n`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

from quart import Quart, Response, current_app

from nanoserve.engine.admission import Prepared
from nanoserve.server import recording
from nanoserve.server.body import parse
from nanoserve.server.errors import ApiError
from nanoserve.server.generation import caps, prepare_all, read_body, request_core_id
from nanoserve.server.jobs import Ended, Item, Job
from nanoserve.server.respond import SseBody, failure, json_response
from nanoserve.server.responses.events import Event, ResponseRenderer
from nanoserve.server.responses.translate import request_echo, responses_error, to_chat_body
from nanoserve.server.state import current_state, ready
from nanoserve.server.tools.output import ChoiceOutput, Delta, OutputPlan


def register(app: Quart) -> None:
    @app.post("/v1/responses")
    async def responses() -> Response:
        st = current_state()
        r = ready(st)
        raw, limits = await read_body(), caps(st, r)

        # Parsed, translated, templated and tokenized off the event loop (offload.py).
        def work() -> tuple[parse.GenerateRequest, list[Prepared], dict[str, Any]]:
            body = parse.loads(raw)
            chat = to_chat_body(body)
            try:
                req = parse.chat(chat, r.api, r.tokenizer, st.config.chat_template, st.now,
                                 st.config.agents, limits)
                prepared = prepare_all(r, req)
            except ApiError as exc:  # named as the Responses request spells the field
                raise responses_error(exc) from None
            return req, prepared, request_echo(body)

        req, prepared, echo = await st.offload.run(work, len(raw))
        rid = f"resp_{request_core_id(st)}"
        renderer = ResponseRenderer(rid, st.config.served_model_name, int(st.now()), echo)
        out = (req.output or OutputPlan()).start(rid, 0)
        job = r.registry.open(rid, prepared, current_app.nursery)  # type: ignore[attr-defined]
        recording.link(job)
        try:
            first = await job.next()
            err = failure(first)
            if err is not None:
                raise err
        except BaseException:
            job.close()
            raise
        headers = {"X-Request-Id": rid.removeprefix("resp_")}
        if req.stream:
            frames = _sse(job, renderer, out, first)
            resp: Response = current_app.response_class(
                SseBody(job, frames), status=200, content_type="text/event-stream",
                headers={**headers, "Cache-Control": "no-cache"})
            resp.timeout = None
            return resp
        try:
            renderer.start()  # the events are not sent; the object they build is
            item = first
            while True:
                _events(renderer, job, out, item)
                if job.done:
                    return json_response(renderer.final(), headers=headers)
                item = await job.next()
                err = failure(item)
                if err is not None:
                    raise err
        finally:
            job.close()


def _events(renderer: ResponseRenderer, job: Job, out: ChoiceOutput, item: Item
            ) -> list[Event]:
    """The Responses events of one update (the end's too, when it is the last)."""
    assert not isinstance(item, Ended)
    _, u = item
    events = _delta_events(renderer, out.feed(u.text))
    if u.finished:
        events += _delta_events(renderer, out.finish())
        reason = "tool_calls" if u.finish_reason == "stop" and out.has_calls else u.finish_reason
        events += renderer.finish(reason, job.num_prompt_tokens, job.num_output_tokens)
    return events


def _delta_events(renderer: ResponseRenderer, d: Delta) -> list[Event]:
    events: list[Event] = []
    if d.reasoning:
        events += renderer.reasoning(d.reasoning)
    if d.content:
        events += renderer.text(d.content)
    for call in d.tool_calls:
        if "id" in call:
            events += renderer.tool_call(call["index"], call["id"], call["function"]["name"])
        if call["function"]["arguments"]:
            events += renderer.tool_arguments(call["index"], call["function"]["arguments"])
    return events


def _frame(event: Event) -> bytes:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


async def _sse(job: Job, renderer: ResponseRenderer, out: ChoiceOutput, item: Item
               ) -> AsyncGenerator[bytes, None]:
    try:
        for event in renderer.start():
            yield _frame(event)
        while True:
            err = failure(item)
            if err is not None:  # the Responses stream's error event, then the end
                yield _frame(renderer.error(err.code, err.message, err.param))
                break
            for event in _events(renderer, job, out, item):
                yield _frame(event)
            if job.done:
                break
            item = await job.next()
    finally:
        job.close()
