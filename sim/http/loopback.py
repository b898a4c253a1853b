"""An ASGI app served by a real Hypercorn socket on 127.0.0.1, in this process.

For the live-server tests, the recorder tests and `sim soak`: everything an HTTP client in
the wild would meet (TCP, HTTP/1.1 framing, send buffers that fill, hang-ups that arrive as
a closed socket) while the server's state stays inspectable. Hypercorn is stopped through
its `shutdown_trigger`, never by cancelling `serve` (docs/ARCHITECTURE.md, pitfalls).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio


@asynccontextmanager
async def hypercorn_on_loopback(app: Any, **settings: Any) -> AsyncIterator[str]:
    """Serve `app` on a free 127.0.0.1 port; yield its URL (`http://127.0.0.1:PORT`).
    `settings` are Hypercorn Config attributes (graceful_timeout 5 s unless given; a test
    may set timeouts, access logs, ...)."""
    import hypercorn.config

    from nanoserve.server import hypercorn_fixes

    config = hypercorn.config.Config()
    config.bind = ["127.0.0.1:0"]
    config.graceful_timeout = 5.0
    for key, value in settings.items():
        if not hasattr(config, key):
            raise TypeError(f"Hypercorn's Config has no setting {key!r}")
        setattr(config, key, value)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(functools.partial(hypercorn_fixes.serve, app, config,
                                                      shutdown_trigger=stop.wait))
        try:
            yield binds[0]
        finally:
            stop.set()
