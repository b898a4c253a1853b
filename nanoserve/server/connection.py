"""The app's HTTP connection class: Quart-Trio's, with the guarantees the app's responses
need about how they end, and the hook that reports the ASGI messages to a recorder.

It is apart from server/app.py because it works below Quart's request handling, on the
ASGI messages themselves; and apart from server/hypercorn_fixes.py because it is the app's
own class, set as `asgi_http_class`, not a patch to the server it runs under.
"""

from __future__ import annotations

from typing import Any

import trio
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable
from quart_trio.asgi import TrioASGIHTTPConnection

from nanoserve.server import recording
from nanoserve.server.respond import SseBody
from nanoserve.server.state import ServerState


class Connection(TrioASGIHTTPConnection):
    """Quart-Trio's HTTP connection, plus two guarantees: once sending a response ends, for
    any reason, the stream behind it is closed (see respond.SseBody); and the last message
    of a response is sent to its end (below). With a recorder, the generation routes' ASGI
    messages are also reported to it (server.recording).

    Why the second: Hypercorn finishes a connection's HTTP exchange inside the app's send of
    the last body message (it closes the socket, or starts the keep-alive timer), and on the
    way it hands the app `http.disconnect`, on which Quart-Trio cancels the request's
    nursery: the send, and Hypercorn's work in it, is cancelled half done. After a 408 for a
    stalled body the socket was then never closed, and the client held the connection for
    as long as it liked. So a disconnect that comes while the last message is being sent
    does not cancel; `handle_request` ends the nursery itself once the send returns."""

    _finishing = False  # the last body message is being sent

    async def __call__(self, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        st: ServerState = self.app.extensions["nanoserve"]
        ex = recording.recorded(st.recorder, self.scope)
        send = self._watch_last(send)
        if ex is None:
            await super().__call__(receive, send)
            return
        try:
            await super().__call__(recording.recording_receive(ex, receive),
                                   recording.recording_send(ex, send))
        finally:
            recording.safely(ex.done)

    def _watch_last(self, send: ASGISendCallable) -> ASGISendCallable:
        async def watched(message: Any) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body"):
                self._finishing = True
            await send(message)

        return watched

    async def handle_messages(  # type: ignore[override]
        self, nursery: trio.Nursery, request: Any, receive: ASGIReceiveCallable
    ) -> None:
        # Quart's own loop: returns on http.disconnect (Quart-Trio then always cancels).
        await super(TrioASGIHTTPConnection, self).handle_messages(request, receive)
        if not self._finishing:
            nursery.cancel_scope.cancel()

    async def _send_response(self, send: ASGISendCallable, response: Any) -> None:
        try:
            await super()._send_response(send, response)
        finally:
            body = getattr(response, "response", None)
            if isinstance(body, SseBody):
                body.close_nowait()

