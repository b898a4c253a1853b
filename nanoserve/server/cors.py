"""CORS: what lets a page on another origin call the server from a browser.

A browser sends a cross-origin `POST` with a JSON body only after a preflight: an `OPTIONS`
request with `Origin` and `Access-Control-Request-Method` (and the headers it means to send
in `Access-Control-Request-Headers`), which carries no credentials by design. So the
preflight is answered here, in ASGI middleware around the app, before routing and the API
key check; the real request then goes through the app as any other, key included, and its
response (an error too: a browser shows a page a 401 only if the CORS headers are on it)
gets `Access-Control-Allow-Origin`.

The headers are exactly those vLLM sends, which uses Starlette's `CORSMiddleware`: its
preflight answer (200 "OK", or 400 "Disallowed CORS origin, method, headers" naming what was
refused), `Access-Control-Max-Age: 600`, `Vary: Origin` whenever the origin is echoed
rather than `*`, requested headers mirrored back under a `*` policy, and on an actual
response the echoed origin when the policy lists origins (or a cookie is sent under `*`).
"""

from __future__ import annotations

from typing import Any

from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable

from nanoserve.server.settings import CorsPolicy

ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
# What a browser sends without asking (the CORS-safelisted request headers), so always allowed.
SAFELISTED_HEADERS = ("Accept", "Accept-Language", "Content-Language", "Content-Type")
MAX_AGE_S = 600

Headers = list[tuple[bytes, bytes]]
App = Any  # an ASGI callable: (scope, receive, send) -> None


class CorsMiddleware:
    def __init__(self, app: App, policy: CorsPolicy) -> None:
        self.app = app
        self.all_origins = "*" in policy.allowed_origins
        self.origins = frozenset(policy.allowed_origins)
        self.methods = ALL_METHODS if "*" in policy.allowed_methods else policy.allowed_methods
        self.all_headers = "*" in policy.allowed_headers
        allowed = sorted(set(SAFELISTED_HEADERS) | set(policy.allowed_headers))
        self.headers = frozenset(h.lower() for h in allowed)
        # With credentials a browser refuses `*`, so the preflight echoes the origin.
        self.echo_on_preflight = not self.all_origins or policy.allow_credentials
        self.simple: dict[str, str] = {}  # set on every cross-origin response
        if self.all_origins:
            self.simple["access-control-allow-origin"] = "*"
        if policy.allow_credentials:
            self.simple["access-control-allow-credentials"] = "true"
        pre = {"vary": "Origin"} if self.echo_on_preflight else \
            {"access-control-allow-origin": "*"}
        pre["access-control-allow-methods"] = ", ".join(self.methods)
        pre["access-control-max-age"] = str(MAX_AGE_S)
        if not self.all_headers:
            pre["access-control-allow-headers"] = ", ".join(allowed)
        if policy.allow_credentials:
            pre["access-control-allow-credentials"] = "true"
        self.preflight_headers = pre

    async def __call__(self, scope: Any, receive: ASGIReceiveCallable,
                       send: ASGISendCallable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = _header_dict(scope["headers"])
        origin = request.get("origin")
        if origin is None:  # same-origin or not a browser: nothing to add
            await self.app(scope, receive, send)
        elif scope["method"] == "OPTIONS" and "access-control-request-method" in request:
            await self._preflight(request, origin, send)
        else:
            await self.app(scope, receive, self._decorated(send, origin, "cookie" in request))

    def allows(self, origin: str) -> bool:
        return self.all_origins or origin in self.origins

    async def _preflight(self, request: dict[str, str], origin: str,
                         send: ASGISendCallable) -> None:
        headers = dict(self.preflight_headers)
        failures = []
        if not self.allows(origin):
            failures.append("origin")
        elif self.echo_on_preflight:
            headers["access-control-allow-origin"] = origin
        if request["access-control-request-method"] not in self.methods:
            failures.append("method")
        asked = request.get("access-control-request-headers")
        if asked is not None and self.all_headers:
            headers["access-control-allow-headers"] = asked  # mirrored: `*` means any
        elif asked is not None and any(h.strip().lower() not in self.headers
                                       for h in asked.split(",")):
            failures.append("headers")
        # The browser enforces the policy whatever the status; a 400 says why in the console.
        status, body = (400, "Disallowed CORS " + ", ".join(failures)) if failures else \
            (200, "OK")
        payload = body.encode()
        raw = [(k.encode(), v.encode("latin-1")) for k, v in headers.items()]
        raw += [(b"content-type", b"text/plain; charset=utf-8"),
                (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": payload, "more_body": False})

    def _decorated(self, send: ASGISendCallable, origin: str, cookie: bool) -> ASGISendCallable:
        async def decorated(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = _replace(list(message.get("headers", [])), self.simple)
                # A cookie under `*` needs the origin itself (a browser rejects `*` with
                # credentials); a listed origin is echoed, as the only way to allow it.
                if (self.all_origins and cookie) or (not self.all_origins
                                                     and self.allows(origin)):
                    headers = _replace(headers, {"access-control-allow-origin": origin})
                    headers = _add_vary(headers, "Origin")
                message = {**message, "headers": headers}
            await send(message)

        return decorated


def _header_dict(headers: Any) -> dict[str, str]:
    """The request's headers by lowercased name, the first of repeated ones."""
    out: dict[str, str] = {}
    for name, value in headers:
        out.setdefault(bytes(name).decode("latin-1").lower(), bytes(value).decode("latin-1"))
    return out


def _replace(headers: Headers, new: dict[str, str]) -> Headers:
    kept = [(k, v) for k, v in headers if k.lower().decode("latin-1") not in new]
    return kept + [(k.encode(), v.encode("latin-1")) for k, v in new.items()]


def _add_vary(headers: Headers, value: str) -> Headers:
    old = next((v.decode("latin-1") for k, v in headers if k.lower() == b"vary"), None)
    return _replace(headers, {"vary": value if old is None else f"{old}, {value}"})
