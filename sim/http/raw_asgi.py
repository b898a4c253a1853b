"""What every hand-written ASGI app here needs: the lifespan answered, the body read, a plain
answer sent. Used by the recording proxy (sim/record/upstream.py), the toy server the
target checks are tested on, and the proxy's benchmark.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]


async def lifespan(receive: Receive, send: Send) -> None:
    """Answer startup (and anything else) as complete until shutdown, then that."""
    while (msg := await receive())["type"] != "lifespan.shutdown":
        await send({"type": msg["type"] + ".complete"})
    await send({"type": "lifespan.shutdown.complete"})


async def read_body(receive: Receive) -> tuple[bytes, bool]:
    """The request's body; True where the client left before sending all of it."""
    parts: list[bytes] = []
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return b"".join(parts), True
        parts.append(msg.get("body", b""))
        if not msg.get("more_body"):
            return b"".join(parts), False


async def respond(send: Send, status: int, content_type: bytes, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type)]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def respond_json(send: Send, status: int, obj: Any) -> None:
    await respond(send, status, b"application/json", json.dumps(obj).encode())
