"""The generation endpoints: `POST /v1/completions` and `POST /v1/chat/completions`.

Both read as the same four lines: parse the body (400 naming the field), prepare every
prompt through the bridge (tokenize and validate: a prompt that can never fit is a 400
here, not a failure later), then hand the job to `respond` for a unary or streamed answer.
Parsing and preparing grow with the body, so they run as one call off the event loop
(offload.py), within the size limits checked on the way (body/limits.py).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from quart import Quart, Response, current_app, request

from nanoserve.engine.admission import Prepared
from nanoserve.sampling.params import ParamError
from nanoserve.server.body import parse
from nanoserve.server.body.limits import Caps
from nanoserve.server.errors import ApiError, from_param_error
from nanoserve.server.render import Shapes
from nanoserve.server.respond import respond
from nanoserve.server.state import Ready, ServerState, current_state, ready

# Visible ASCII, no spaces: the id goes into logs and headers verbatim.
_REQUEST_ID = re.compile(r"[!-~]{1,128}")


def request_core_id(st: ServerState) -> str:
    """The client's X-Request-Id if it sent one, else a fresh id from the app's source."""
    given = request.headers.get("X-Request-Id")
    if given is None:
        return st.next_id()
    if not _REQUEST_ID.fullmatch(given):
        raise ApiError(400, "X-Request-Id must be 1 to 128 visible ASCII characters",
                       "X-Request-Id", "invalid_value")
    return given


async def read_body() -> bytes:
    # get_data applies MAX_CONTENT_LENGTH (413) and BODY_TIMEOUT (408).
    return await request.get_data(cache=False, as_text=False, parse_form_data=False)


async def read_json() -> dict[str, object]:
    """The body, parsed off the event loop: a megabyte of JSON is tens of milliseconds."""
    raw = await read_body()
    return await current_state().offload.run(lambda: parse.loads(raw), len(raw))


def caps(st: ServerState, r: Ready) -> Caps:
    return Caps.of(st.config.limits, r.engine.max_model_len)


def prepare_all(r: Ready, req: parse.GenerateRequest) -> list[Prepared]:
    """Tokenize, check and compile each prompt's grammar: called in a worker thread, which
    Engine.prepare allows (it changes nothing)."""
    try:
        return [r.bridge.prepare(p, req.params) for p in req.prompts]
    except ParamError as exc:
        raise from_param_error(exc) from None


async def _generate(
    st: ServerState, r: Ready, kind: str, req: parse.GenerateRequest,
    prepared: list[Prepared], prefixes: Sequence[str] | None,
) -> Response:
    core = request_core_id(st)
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    shapes = Shapes(kind, f"{prefix}-{core}", int(st.now()), st.config.served_model_name,
                    r.tokens, req.params.logprobs is not None,
                    num_top=req.params.logprobs or 0, prompt_logprobs=req.prompt_logprobs,
                    token_ids=req.return_token_ids, output=req.output)
    return await respond(
        r.registry, current_app.nursery, prepared, shapes, prefixes,  # type: ignore[attr-defined]
        stream=req.stream, usage=req.usage, headers={"X-Request-Id": core},
    )


def register(app: Quart) -> None:
    @app.post("/v1/completions")
    async def completions() -> Response:
        st = current_state()
        r = ready(st)
        raw, limits = await read_body(), caps(st, r)

        def work() -> tuple[parse.GenerateRequest, list[Prepared], list[str] | None]:
            req = parse.completion(parse.loads(raw), r.api, limits)
            prefixes: list[str] | None = None
            if req.echo:
                # As vLLM: the prompt is echoed whole, special tokens included, so the text
                # says what its logprobs' tokens say; skip_special_tokens is about generated
                # text.
                prefixes = [p if isinstance(p, str) else r.tokenizer.decode(
                    p, skip_special_tokens=False) for p in req.prompts]
            return req, prepare_all(r, req), prefixes

        req, prepared, prefixes = await st.offload.run(work, len(raw))
        return await _generate(st, r, "completion", req, prepared, prefixes)

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        st = current_state()
        r = ready(st)
        raw, limits = await read_body(), caps(st, r)

        def work() -> tuple[parse.GenerateRequest, list[Prepared]]:
            req = parse.chat(parse.loads(raw), r.api, r.tokenizer, st.config.chat_template,
                             st.now, st.config.agents, limits)
            return req, prepare_all(r, req)

        req, prepared = await st.offload.run(work, len(raw))
        return await _generate(st, r, "chat", req, prepared, None)
