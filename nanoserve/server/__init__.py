"""HTTP serving: the OpenAI-compatible API (with vLLM's extensions) on Quart-Trio.

    app.py       create_app(): the app around one engine; auth, errors
    lifespan.py  the engine task: started with the app, the weights loaded, stopped with it
    connection.py  the app's ASGI connection: how a response ends; the recorder's hook
    settings.py  ServerConfig: the settings serve's flags decide; state.py: the app's state
    recording.py the `serve --record` hook (the recorder comes from an entry point)
    generation.py  POST /v1/completions, POST /v1/chat/completions
    body/        a request body, from bytes to SamplingParams and prompts: its models
                 (validation and /openapi.json), its size limits, its 400s (its own map)
    responses/   POST /v1/responses (stateless), on the chat machinery (its own map)
    tools/       tool calls and reasoning read out of the text (parsers by vLLM's names),
                 a request's tools planned and their constraints (plan.py, constrained.py)
    templates/   the built-in chat templates (`--chat-template chatml-tools`)
    admin.py     GET /health, /v1/models, /metrics; POST /tokenize, /detokenize
    openapi.py   GET /openapi.json: the OpenAPI 3.1 document of these routes
    errors.py    the OpenAI error object, and the one exception that produces it
    checks.py    serve's settings judged before the socket is bound, and the bind itself
    offload.py   request-sized work off the event loop
    cors.py      CORS: what lets a page on another origin call the server
    respond.py   a job -> a unary JSON body or an SSE stream; status before the first byte
    render.py    response shapes: choices, chunks, logprobs, usage
    token_text.py  a token's bytes and display text (logprobs)
    jobs.py      requests in flight: merged streams, queue limit, drain on shutdown
    metrics.py   /metrics through prometheus_client
    hypercorn_fixes.py  HTTP/2 send race, reason phrases (installed before serving)
    main.py      `nanoserve serve`: its configs, weights loading, Hypercorn, signals
    serve_flags.py  `nanoserve serve`'s flags, in --help's groups

This layer sits on `bridge.AsyncEngine` and never touches the engine while it steps.
"""

from nanoserve.server.app import create_app, drain, server_state
from nanoserve.server.settings import ServerConfig
from nanoserve.server.state import counter_ids

__all__ = ["ServerConfig", "counter_ids", "create_app", "drain", "server_state"]
