"""CORS over a real socket: what a browser on another origin sends, and the headers vLLM
(Starlette's CORSMiddleware) answers with (issue 26, item 10).

A page's `fetch()` of `/v1/completions` with a JSON body and a bearer key is preceded by a
preflight: `OPTIONS` with `Origin`, `Access-Control-Request-Method: POST` and
`Access-Control-Request-Headers: authorization,content-type`, and never a credential. The
preflight used to get 401 with `--api-key` and, without one, 200 with no `Access-Control-*`
header: either way the browser blocked the call. Every exchange here goes through Hypercorn
on loopback; the last test runs `nanoserve serve` itself with the flags.
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import partial
from typing import Any

import httpx
import pytest
import trio
from support.server_harness import GOOD, keep_reading, make_app, read_until_ready

from nanoserve.server.settings import CorsPolicy
from sim.http.loopback import hypercorn_on_loopback

KEY = "sk-cors-test"
PAGE = "https://app.example"
ALL_METHODS = "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"
PREFLIGHT = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}
CORS_NAMES = ("access-control-allow-origin", "access-control-allow-methods",
              "access-control-allow-headers", "access-control-allow-credentials",
              "access-control-max-age", "vary")


def cors(r: httpx.Response) -> dict[str, str]:
    """The response's CORS headers (and Vary), by lowercased name."""
    return {k: v for k, v in r.headers.items() if k in CORS_NAMES}


async def exchanges(app: Any, *requests: tuple[str, dict[str, str], Any]) -> list[httpx.Response]:
    async with hypercorn_on_loopback(app) as url, \
            httpx.AsyncClient(base_url=url, timeout=60) as client:
        return [await client.request(method, "/v1/completions", headers=headers, json=body)
                for method, headers, body in requests]


@pytest.mark.parametrize("api_key", [None, KEY])
async def test_default_policy_answers_the_preflight_and_marks_every_response(
    api_key: str | None,
) -> None:
    auth = {"Authorization": f"Bearer {KEY}"} if api_key else {}
    pre, post, refused = await exchanges(
        make_app(api_key=api_key),
        ("OPTIONS", PREFLIGHT, None),  # no credential: a browser never sends one here
        ("POST", {"Origin": PAGE, **auth}, GOOD),
        ("POST", {"Origin": PAGE, "Authorization": "Bearer wrong"}, GOOD))
    assert (pre.status_code, pre.text) == (200, "OK")
    assert pre.headers["content-type"] == "text/plain; charset=utf-8"
    assert cors(pre) == {"access-control-allow-origin": "*",
                         "access-control-allow-methods": ALL_METHODS,
                         "access-control-allow-headers": "authorization,content-type",
                         "access-control-max-age": "600"}
    assert post.status_code == 200, post.text
    assert post.json()["usage"]["completion_tokens"] == 4
    assert cors(post) == {"access-control-allow-origin": "*"}
    # The real request still needs the key; its 401 carries the header so the page can read it.
    assert refused.status_code == (401 if api_key else 200)
    assert cors(refused) == {"access-control-allow-origin": "*"}


async def test_listed_origins_with_credentials_echo_the_origin_and_refuse_others() -> None:
    policy = CorsPolicy(allowed_origins=(PAGE,), allow_credentials=True)
    auth = {"Authorization": f"Bearer {KEY}"}
    other = "https://evil.example"
    pre, post, stranger_pre, stranger_post, no_key = await exchanges(
        make_app(api_key=KEY, cors=policy),
        ("OPTIONS", PREFLIGHT, None),
        ("POST", {"Origin": PAGE, **auth}, GOOD),
        ("OPTIONS", {**PREFLIGHT, "Origin": other}, None),
        ("POST", {"Origin": other, **auth}, GOOD),
        ("POST", {"Origin": PAGE}, GOOD))
    assert (pre.status_code, pre.text) == (200, "OK")
    assert cors(pre) == {"access-control-allow-origin": PAGE, "vary": "Origin",
                         "access-control-allow-methods": ALL_METHODS,
                         "access-control-allow-headers": "authorization,content-type",
                         "access-control-allow-credentials": "true",
                         "access-control-max-age": "600"}
    assert post.status_code == 200, post.text
    assert cors(post) == {"access-control-allow-origin": PAGE, "vary": "Origin",
                          "access-control-allow-credentials": "true"}
    # A page not listed: the preflight says so (the browser stops there) ...
    assert (stranger_pre.status_code, stranger_pre.text) == (400, "Disallowed CORS origin")
    assert "access-control-allow-origin" not in stranger_pre.headers
    # ... and a request sent anyway (curl) is served without an origin the browser accepts.
    assert stranger_post.status_code == 200
    assert "access-control-allow-origin" not in stranger_post.headers
    assert no_key.status_code == 401
    assert cors(no_key)["access-control-allow-origin"] == PAGE


async def test_listed_methods_and_headers_are_checked_and_named() -> None:
    policy = CorsPolicy(allowed_methods=("POST",), allowed_headers=("Authorization",))
    ok, bad_method, bad_header = await exchanges(
        make_app(cors=policy),
        ("OPTIONS", PREFLIGHT, None),
        ("OPTIONS", {**PREFLIGHT, "Access-Control-Request-Method": "PUT"}, None),
        ("OPTIONS", {**PREFLIGHT, "Access-Control-Request-Headers": "x-trace"}, None))
    assert ok.status_code == 200
    # The safelisted headers are always allowed, and listed with the policy's own.
    assert cors(ok) == {"access-control-allow-origin": "*",
                        "access-control-allow-methods": "POST",
                        "access-control-allow-headers": "Accept, Accept-Language, "
                        "Authorization, Content-Language, Content-Type",
                        "access-control-max-age": "600"}
    assert (bad_method.status_code, bad_method.text) == (400, "Disallowed CORS method")
    assert (bad_header.status_code, bad_header.text) == (400, "Disallowed CORS headers")


async def test_requests_without_an_origin_get_no_cors_headers() -> None:
    [r] = await exchanges(make_app(), ("POST", {}, GOOD))
    assert r.status_code == 200
    assert cors(r) == {}


async def test_nanoserve_serve_takes_vllms_flags() -> None:
    serve = [sys.executable, "-m", "nanoserve.cli", "serve", "--model", "stub", "--port", "0",
             "--num-blocks", "1024", "--api-key", KEY, "--allowed-origins", json.dumps([PAGE]),
             "--allowed-methods", '["GET", "POST"]', "--allow-credentials"]
    log: list[str] = []
    with trio.fail_after(120):  # a bound on a hang, not a timing assertion
        async with trio.open_nursery() as nursery:
            proc: Any = await nursery.start(partial(
                trio.run_process, serve, stderr=subprocess.PIPE, check=False))
            url = await read_until_ready(proc.stderr, log)
            nursery.start_soon(keep_reading, proc.stderr, log)
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                pre = await client.options("/v1/completions", headers=PREFLIGHT)
                post = await client.post("/v1/completions", json=GOOD, headers={
                    "Origin": PAGE, "Authorization": f"Bearer {KEY}"})
            proc.terminate()
    assert proc.returncode == 0, "\n".join(log)
    assert (pre.status_code, pre.text) == (200, "OK")
    assert cors(pre) == {"access-control-allow-origin": PAGE, "vary": "Origin",
                         "access-control-allow-methods": "GET, POST",
                         "access-control-allow-headers": "authorization,content-type",
                         "access-control-allow-credentials": "true",
                         "access-control-max-age": "600"}
    assert post.status_code == 200, post.text
    assert cors(post) == {"access-control-allow-origin": PAGE, "vary": "Origin",
                          "access-control-allow-credentials": "true"}
