"""The limits and the key, where tests/test_server_api.py leaves a gap: a chunked body over
the size limit (no Content-Length to refuse early), a prompt plus max_tokens over a context
the size of the pool, `n` at and just over MAX_N, the API key on every route and method but /health
(unknown routes included), no secret in any log line of a real Hypercorn socket with
access logging on at DEBUG, and an answer given before its body arrived (a 401, a 404) that
waits for the body, so the keep-alive connection lives on."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from support.http_harness import hypercorn_on_loopback, serving
from support.server_harness import GOOD, assert_error, assert_serving, make_app, make_engine

from nanoserve.bridge.clock import LiveClock
from nanoserve.sampling.params import MAX_N

SECRET = "sk-limits-0123456789abcdef"


async def test_chunked_body_over_the_limit_is_413() -> None:
    async with serving(make_app(max_body_bytes=1000)) as h:
        # No Content-Length: the limit must hold while the body streams in.
        ex = await h.open("POST", "/v1/completions", complete_body=False)
        for _ in range(3):
            await ex.send_body(b" " * 600, more=True)
        await ex.send_body(json.dumps(GOOD).encode())
        err = assert_error(await ex.read_all(), 413, None)
        assert err["code"] == "body_too_large"
        declared = await h.request("POST", "/v1/completions", body=b"{}",
                                   headers={"content-length": "1001"})
        assert_error(declared, 413, None)
        await assert_serving(h)


async def test_prompt_plus_max_tokens_over_a_pool_sized_context_is_400() -> None:
    # EngineConfig refuses a pool smaller than one max_model_len sequence, so the context
    # check is what stands between a request and the pool: 4 blocks of 16 = 64 tokens.
    async with serving(make_app(make_engine(num_blocks=4, max_model_len=64))) as h:
        ok = await h.post("/v1/completions", {**GOOD, "prompt": [5] * 40, "max_tokens": 24})
        assert ok.status == 200, ok.body
        err = assert_error(await h.post("/v1/completions", {
            **GOOD, "prompt": [5] * 40, "max_tokens": 25}), 400, "max_tokens")
        assert "exceeds max_model_len 64 by 1" in err["message"]
        chat = {"messages": [{"role": "user", "content": "x " * 80}], "max_tokens": 1}
        assert_error(await h.post("/v1/chat/completions", chat), 400, "max_tokens")
        await assert_serving(h)


async def test_prompt_longer_than_max_model_len_is_400_naming_prompt() -> None:
    async with serving(make_app(make_engine(max_model_len=32))) as h:
        err = assert_error(await h.post("/v1/completions", {
            **GOOD, "prompt": [5] * 32, "max_tokens": None}), 400, "prompt")
        assert "max_model_len 32" in err["message"]
        chat = {"messages": [{"role": "user", "content": "x " * 40}]}
        assert_error(await h.post("/v1/chat/completions", chat), 400, "prompt")
        await assert_serving(h)


async def test_n_at_and_over_max_n() -> None:
    async with serving(make_app()) as h:
        body = {**GOOD, "prompt": [5], "max_tokens": 1}
        r = await h.post("/v1/completions", {**body, "n": MAX_N})
        assert r.status == 200
        assert len(r.json()["choices"]) == MAX_N
        err = assert_error(await h.post("/v1/completions", {**body, "n": MAX_N + 1}), 400, "n")
        assert f"[1, {MAX_N}]" in err["message"]
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        assert_error(await h.post("/v1/chat/completions", {**chat, "n": MAX_N + 1}), 400, "n")


async def test_every_route_and_method_but_health_needs_the_key() -> None:
    app = make_app(api_key=SECRET)
    rules = [(r.rule, sorted(r.methods)) for r in app.url_map.iter_rules()]
    assert len(rules) == 11  # /server_info, /tokenizer_info and /v1/responses among them
    probes = [(path, m) for path, methods in rules for m in {*methods, "DELETE"}]
    probes += [("/nowhere", "GET"), ("/v1", "POST"), ("/health/", "GET")]
    good = {"authorization": f"Bearer {SECRET}"}
    async with serving(app) as h:
        for path, method in probes:
            r = await h.request(method, path, body=b"{}")
            if path == "/health":
                assert r.status == (405 if method == "DELETE" else 200), (method, r.body)
                continue
            err = assert_error(r, 401, None)
            assert err["code"] == "invalid_api_key", (method, path)
            keyed = await h.request(method, path, body=b"{}", headers=good)
            assert keyed.status != 401, (method, path)


@asynccontextmanager
async def logged_server(app: Any) -> AsyncIterator[str]:
    """Hypercorn on loopback with its access log on, into the `hypercorn.access` logger."""
    async with hypercorn_on_loopback(app, accesslog=logging.getLogger("hypercorn.access"),
                                     errorlog=logging.getLogger("hypercorn.error"),
                                     loglevel="DEBUG") as url:
        yield url


def exercise(url: str) -> list[int]:
    """A keyed client's life: good key (unary, stream, error), wrong keys, no key."""
    statuses = []
    with httpx.Client(base_url=url, timeout=60) as c:
        good = {"Authorization": f"Bearer {SECRET}"}
        for headers, path, body in [
            (good, "/v1/completions", GOOD),
            (good, "/v1/completions", {**GOOD, "stream": True}),
            (good, "/v1/completions", {**GOOD, "n": 0}),
            ({"Authorization": f"Bearer {SECRET[:-1]}X"}, "/v1/completions", GOOD),
            ({"Authorization": SECRET}, "/tokenize", {"prompt": "x"}),
            ({"Authorization": f"Basic {SECRET}"}, "/metrics", None),
            ({}, "/openapi.json", None),
        ]:
            r = (c.post(path, json=body, headers=headers) if body is not None
                 else c.get(path, headers=headers))
            statuses.append(r.status_code)
    return statuses


async def test_the_key_never_reaches_a_log(caplog: pytest.LogCaptureFixture,
                                           capfd: pytest.CaptureFixture[str]) -> None:
    caplog.set_level(logging.DEBUG)  # every logger: the app's, Quart's, Hypercorn's
    app = make_app(clock=LiveClock(), api_key=SECRET)
    async with logged_server(app) as url:
        statuses = await trio.to_thread.run_sync(exercise, url)
    assert statuses == [200, 200, 400, 401, 401, 401, 401]
    access = [r.getMessage() for r in caplog.records if r.name == "hypercorn.access"]
    assert len(access) == 7, "\n".join(access)
    assert "POST /v1/completions" in access[0]
    out, err = capfd.readouterr()
    for text in (caplog.text, out, err, *access):
        assert SECRET not in text
        assert SECRET[:-1] not in text  # nor the wrong key, which is nearly the key


async def test_an_answer_decided_before_the_body_waits_for_it() -> None:
    # A 401 (from the headers) and a 404 (from the path) need no body, but were they sent
    # before it, Hypercorn would end the connection under a keep-alive client's next request.
    keyed = {"authorization": f"Bearer {SECRET}"}
    async with serving(make_app(api_key=SECRET)) as h:
        for path, headers, status in [("/v1/completions", {}, 401),
                                      ("/nowhere", keyed, 404)]:
            body = json.dumps(GOOD).encode()
            ex = await h.open("POST", path, complete_body=False,
                              headers={**headers, "content-length": str(len(body))})
            await ex.send_body(body[:10], more=True)
            await trio.testing.wait_all_tasks_blocked()
            ex.poll()
            assert ex.status is None, f"{path} answered {ex.status} before its body"
            await ex.send_body(body[10:])
            assert_error(await ex.read_all(), status, None)


async def test_a_401_keeps_a_keep_alive_connection() -> None:
    # The real socket: the headers of a refused request, then (once the server has done all
    # it can with them) its body and a second request on the same connection. Both answers
    # come back; without waiting for the body, the server closed after the 401.
    body = json.dumps(GOOD).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    async with hypercorn_on_loopback(make_app(clock=LiveClock(), api_key=SECRET)) as url:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            await stream.send_all(head)
            await trio.testing.wait_all_tasks_blocked()
            await stream.send_all(body + b"GET /health HTTP/1.1\r\nhost: x\r\n"
                                  b"connection: close\r\n\r\n")
            received = b""
            with trio.fail_after(60):  # a bound, not a stopwatch: the server must close
                while chunk := await stream.receive_some():  # after /health
                    received += chunk
    # A status line follows the previous body directly: no CRLF before the second one.
    assert re.findall(rb"HTTP/1\.1 (\d{3}) ", received) == [b"401", b"200"], received
