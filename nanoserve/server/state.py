"""What the server knows: its settings, and the state the routes share."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import trio
from quart import current_app

from nanoserve.bridge import AsyncEngine
from nanoserve.engine.engine import Engine
from nanoserve.server.body.protocol import Protocol
from nanoserve.server.errors import ApiError
from nanoserve.server.jobs import Registry
from nanoserve.server.metrics import Metrics
from nanoserve.server.offload import Offload
from nanoserve.server.recording import Recorder
from nanoserve.server.settings import ServerConfig
from nanoserve.server.token_text import TokenText
from nanoserve.tokenizer import Tokenizer


def counter_ids(start: int = 0) -> Callable[[], str]:
    """Request ids from a counter: what a replay needs to reproduce its responses."""
    counter = itertools.count(start)
    return lambda: f"{next(counter)}"


@dataclass(slots=True, eq=False)
class Ready:
    """Everything that exists once the model has loaded and the bridge is running."""

    engine: Engine
    bridge: AsyncEngine
    registry: Registry
    tokens: TokenText
    api: Protocol  # the request models, with this model's vocabulary and context

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer


@dataclass(slots=True, eq=False)
class ServerState:
    config: ServerConfig
    metrics: Metrics
    next_id: Callable[[], str]  # a fresh id suffix per request
    now: Callable[[], float]  # epoch seconds, for `created`
    ready: Ready | None = None
    loaded: trio.Event = field(default_factory=trio.Event)  # set once `ready` is
    load_error: str | None = None
    draining: bool = False
    recorder: Recorder | None = None  # serve --record (server.recording)
    # Where request-sized work runs: threads on the live clock, inline on a replay's.
    offload: Offload = field(default_factory=lambda: Offload(None))


def current_state() -> ServerState:
    st: ServerState = current_app.extensions["nanoserve"]
    return st


def ready(st: ServerState) -> Ready:
    """The loaded model and bridge, or the 503 that says why there are none yet."""
    if st.ready is None:
        if st.load_error is not None:
            raise ApiError(503, f"the model failed to load: {st.load_error}", None,
                           "model_load_failed")
        raise ApiError(503, "the model is still loading; retry shortly", None, "model_loading",
                       {"Retry-After": "5"})
    return st.ready
