"""The endpoints around generation: health, models, server info, metrics, tokenize and
detokenize.

`/health` is the one route without authentication (load balancers probe it without keys);
it answers 503 while weights load, after a failed load, once a shutdown has begun, and when
the bridge's loop has died, so a balancer stops sending traffic in each of those cases.
`/tokenize` and `/detokenize` take vLLM's request and response shapes, and `/tokenizer_info`
answers as vLLM's does: the tokenizer's config (tokenizer_config.json, less file paths) with
its class and the chat template the server renders with; like every route but `/health` it
needs the key (it shows the chat template). `/server_info` is
SGLang's route of that name cut to the one field its router (sglang-router 0.3, in front of
replicas) reads when it registers a worker: `served_model_name`, the model it files the
worker under (without the route it files it as "unknown", and lists that in its
`/v1/models`).
"""

from __future__ import annotations

from typing import Any

from quart import Quart, Response, current_app, request

from nanoserve.sampling.params import ParamError, check_vocab
from nanoserve.server.body import parse
from nanoserve.server.body.protocol import validate
from nanoserve.server.errors import ApiError, bad_request, from_param_error
from nanoserve.server.generation import read_body, read_json
from nanoserve.server.respond import json_response
from nanoserve.server.state import current_state, ready
from nanoserve.tokenizer import Tokenizer


def register(app: Quart) -> None:
    """The admin routes (ROUTES, below) on `app`."""
    for method, path, view in ROUTES:
        app.add_url_rule(path, view.__name__, view, methods=[method])


async def health() -> Response:
    st = current_state()
    if st.draining:
        raise ApiError(503, "the server is shutting down", None, "shutting_down")
    r = ready(st)  # 503 while loading or after a failed load
    if not r.bridge.healthy:
        raise ApiError(503, "the engine loop has failed", None, "engine_dead")
    return json_response({"status": "ok"})

async def models() -> Response:
    st = current_state()
    name = st.config.served_model_name
    max_len = st.ready.engine.max_model_len if st.ready else None
    card = {"id": name, "object": "model", "created": int(st.now()), "owned_by": "nanoserve",
            "root": st.config.model_root or name, "parent": None, "max_model_len": max_len}
    return json_response({"object": "list", "data": [card]})

async def server_info() -> Response:
    return json_response({"served_model_name": current_state().config.served_model_name})

async def metrics() -> Response:
    body, content_type = current_state().metrics.render(request.headers.get("Accept"))
    resp: Response = current_app.response_class(body, status=200,
                                                content_type=content_type)
    return resp

async def tokenize() -> Response:
    st = current_state()
    r = ready(st)
    raw = await read_body()

    def work() -> tuple[list[int], list[str] | None]:  # a large body's off the loop (offload.py)
        body = parse.loads(raw)
        parse.check_model(body, st.config.served_model_name)
        req = validate(r.api.tokenize, body)
        if req.messages is not None:
            parse.require_template(r.tokenizer, st.config.chat_template)
            text = parse.chat_text(req.messages, req.add_generation_prompt, r.tokenizer,
                                   st.config.chat_template, st.now)
        elif req.prompt is None:
            raise bad_request("prompt", "prompt (a string) or messages is required",
                              "missing")
        else:
            text = req.prompt
        # vLLM's defaults, which are what generation does: a prompt gets the tokenizer's
        # special tokens, rendered messages only the template's
        specials = (req.messages is None if req.add_special_tokens is None
                    else req.add_special_tokens)
        ids = r.tokenizer.encode(text, add_special_tokens=bool(specials))
        # The vocabulary's own strings ("Ġis"), as vLLM returns them: a client maps these
        # back to ids, which decoded text (" is") cannot do.
        strs = ([r.tokenizer.id_to_token(t) or "" for t in ids] if req.return_token_strs
                else None)
        return ids, strs

    ids, strs = await st.offload.run(work, len(raw))
    return json_response({"count": len(ids), "max_model_len": r.engine.max_model_len,
                          "tokens": ids, "token_strs": strs})

async def tokenizer_info() -> Response:
    st = current_state()
    tok = ready(st).tokenizer
    return json_response(tokenizer_config(tok, st.config.chat_template))

async def detokenize() -> Response:
    st = current_state()
    r = ready(st)
    body = await read_json()
    parse.check_model(body, st.config.served_model_name)
    ids = validate(r.api.detokenize, body).tokens
    try:
        check_vocab("tokens", ids, r.engine.model.config.vocab_size)
    except ParamError as exc:
        raise from_param_error(exc) from None
    return json_response({"prompt": r.tokenizer.decode(ids)})


# (method, path, view): every admin route, registered by `register`.
ROUTES = (
    ("GET", "/health", health),
    ("GET", "/v1/models", models),
    ("GET", "/server_info", server_info),
    ("GET", "/metrics", metrics),
    ("POST", "/tokenize", tokenize),
    ("GET", "/tokenizer_info", tokenizer_info),
    ("POST", "/detokenize", detokenize),
)


def tokenizer_config(tok: Tokenizer, chat_template: str | None) -> dict[str, Any]:
    """vLLM's `/tokenizer_info` body: the config's entries, an added token's `{"content":
    ...}` object as its text, file paths dropped (they name files of the server's disk)."""

    def plain(v: Any) -> Any:
        if isinstance(v, dict):
            return v["content"] if "content" in v else {k: plain(x) for k, x in v.items()}
        return [plain(x) for x in v] if isinstance(v, list) else v

    out = {k: plain(v) for k, v in tok.config.items() if k not in ("vocab_file", "merges_file")}
    # What transformers would load a bare tokenizer.json as, when the config names no class.
    out.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    template = chat_template or tok.chat_template
    if template is not None:
        out["chat_template"] = template
    return out
