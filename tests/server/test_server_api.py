"""The HTTP API in-process, through the ASGI harness, on the stub model: every bad request
gets the right status and an OpenAI error object naming the field, the server keeps serving
after each, and the non-generation routes (auth, ids, queue limit, metrics, tokenize,
models, health while loading) behave as documented."""

from __future__ import annotations

import json
import math
import re
import threading
from typing import Any

import pytest
import trio
import trio.testing
from prometheus_client.openmetrics import parser as openmetrics_parser
from prometheus_client.parser import text_string_to_metric_families
from support.http_harness import serving, stub_parts
from support.server_harness import (
    CREATED,
    GOOD,
    assert_error,
    assert_serving,
    make_app,
    make_engine,
)

from nanoserve.bridge.clock import GateClock, StepClock
from nanoserve.config import SpeculativeConfig
from nanoserve.engine.engine import Engine
from nanoserve.server import ServerConfig, create_app, server_state
from nanoserve.server.metrics import TTFT_BUCKETS

CHAT = {"model": "stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BAD_REQUESTS: list[tuple[str, str, Any, int, str | None]] = [
    # (case, path, body, status, param); a bytes body is sent as-is
    ("malformed json", "/v1/completions", b'{"prompt": "x",', 400, None),
    ("nan is not json", "/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, None),
    ("body not an object", "/v1/completions", [1, 2], 400, None),
    ("max_tokens wrong type", "/v1/completions", {**GOOD, "max_tokens": "ten"}, 400,
     "max_tokens"),
    ("temperature negative", "/v1/completions", {**GOOD, "temperature": -1}, 400,
     "temperature"),
    ("top_p out of range", "/v1/completions", {**GOOD, "top_p": 2}, 400, "top_p"),
    ("n is a bool", "/v1/completions", {**GOOD, "n": True}, 400, "n"),
    ("huge n", "/v1/completions", {**GOOD, "n": 10**6}, 400, "n"),
    ("huge max_tokens", "/v1/completions", {**GOOD, "max_tokens": 10**9}, 400, "max_tokens"),
    ("logprobs over cap", "/v1/completions", {**GOOD, "logprobs": 50}, 400, "logprobs"),
    ("stop_token_ids a string", "/v1/completions", {**GOOD, "stop_token_ids": "2"}, 400,
     "stop_token_ids"),
    ("logit_bias bad key", "/v1/completions", {**GOOD, "logit_bias": {"x": 1}}, 400,
     "logit_bias"),
    ("stop_token_ids outside vocab", "/v1/completions", {**GOOD, "stop_token_ids": [10**7]},
     400, "stop_token_ids"),
    ("empty prompt", "/v1/completions", {**GOOD, "prompt": ""}, 400, "prompt"),
    ("empty prompt list", "/v1/completions", {**GOOD, "prompt": []}, 400, "prompt"),
    ("empty token list", "/v1/completions", {**GOOD, "prompt": [[]]}, 400, "prompt"),
    ("mixed prompt list", "/v1/completions", {**GOOD, "prompt": ["a", 1]}, 400, "prompt"),
    ("missing prompt", "/v1/completions", {"model": "stub"}, 400, "prompt"),
    ("token id outside vocab", "/v1/completions", {**GOOD, "prompt": [10**7]}, 400, "prompt"),
    ("prompt can never fit", "/v1/completions",
     {**GOOD, "prompt": [5] * 1100, "max_tokens": None}, 400, "prompt"),
    ("prompt plus max_tokens too long", "/v1/completions",
     {**GOOD, "prompt": [5] * 1000, "max_tokens": 100}, 400, "max_tokens"),
    ("stream not a bool", "/v1/completions", {**GOOD, "stream": "maybe"}, 400, "stream"),
    ("stream_options without stream", "/v1/completions",
     {**GOOD, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("continuous_usage_stats not a bool", "/v1/completions",
     {**GOOD, "stream": True, "stream_options": {"continuous_usage_stats": 2}}, 400,
     "stream_options.continuous_usage_stats"),
    ("echo with logprobs out of range", "/v1/completions",
     {**GOOD, "echo": True, "logprobs": 21}, 400, "logprobs"),
    ("unknown model", "/v1/completions", {**GOOD, "model": "gpt-9"}, 404, "model"),
    ("model not a string", "/v1/completions", {**GOOD, "model": 3}, 400, "model"),
    ("unknown route", "/v1/nothing", GOOD, 404, None),
    ("messages not a list", "/v1/chat/completions", {**CHAT, "messages": "hi"}, 400,
     "messages"),
    ("message without role", "/v1/chat/completions", {**CHAT, "messages": [{"content": "x"}]},
     400, "messages[0].role"),
    ("image content part", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content"),
    ("a tool without its function", "/v1/chat/completions",
     {**CHAT, "tools": [{"type": "function"}]}, 400, "tools[0].function"),
    ("tool_choice auto without tools", "/v1/chat/completions",
     {**CHAT, "tool_choice": "auto"}, 400, "tool_choice"),
    ("tools on the completions route", "/v1/completions", {**GOOD, "tools": []}, 400,
     "tools"),
    ("response_format json_schema without one", "/v1/chat/completions",
     {**CHAT, "response_format": {"type": "json_schema"}}, 400,
     "response_format.json_schema"),
    ("response_format schema that does not compile", "/v1/chat/completions",
     {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
         "name": "x", "schema": {"type": "nope"}}}}, 400,
     "response_format.json_schema.schema"),
    ("two constraints", "/v1/completions",
     {**GOOD, "guided_regex": "[0-9]+", "guided_choice": ["a", "b"]}, 400, "guided_choice"),
    ("guided_json not JSON", "/v1/completions", {**GOOD, "guided_json": "{"}, 400,
     "guided_json"),
    ("top_logprobs without logprobs", "/v1/chat/completions", {**CHAT, "top_logprobs": 2},
     400, "top_logprobs"),
    ("top_logprobs over cap", "/v1/chat/completions",
     {**CHAT, "logprobs": True, "top_logprobs": 30}, 400, "top_logprobs"),
    ("chat max_completion_tokens wrong", "/v1/chat/completions",
     {**CHAT, "max_completion_tokens": -1}, 400, "max_tokens"),
    ("detokenize outside vocab", "/detokenize", {"tokens": [10**7]}, 400, "tokens"),
    ("tokenize without prompt", "/tokenize", {}, 400, "prompt"),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [pytest.param(*case[1:], id=case[0]) for case in BAD_REQUESTS],
)
async def test_bad_request_gets_error_object_and_server_keeps_serving(
    path: str, body: Any, status: int, param: str | None
) -> None:
    async with serving(make_app()) as h:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        assert_error(await h.request("POST", path, body=raw), status, param)
        await assert_serving(h)


async def test_unknown_fields_are_ignored_and_method_not_allowed() -> None:
    async with serving(make_app()) as h:
        r = await h.post("/v1/completions", {**GOOD, "frobnicate": {"x": 1}, "user": "u"})
        assert r.status == 200
        assert_error(await h.request("GET", "/v1/completions"), 405, None)
        await assert_serving(h)


async def test_oversize_body_is_413() -> None:
    async with serving(make_app(max_body_bytes=1000)) as h:
        big = {**GOOD, "prompt": "x" * 2000}
        err = assert_error(await h.post("/v1/completions", big), 413, None)
        assert "1000" in err["message"]
        await assert_serving(h)


async def test_stalled_body_is_408(autojump_clock: trio.testing.MockClock) -> None:
    async with serving(make_app(body_timeout=30.0)) as h:
        ex = await h.open("POST", "/v1/completions", complete_body=False,
                          headers={"content-length": "100"})
        await ex.send_body(b'{"prompt": "half a bo', more=True)  # ... and nothing more
        start = trio.current_time()
        with trio.fail_after(60):  # virtual seconds: without the body timeout this fails, not hangs
            r = await ex.read_all()
        assert_error(r, 408, None)
        assert trio.current_time() - start == pytest.approx(30.0)
        await assert_serving(h)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/models", "/metrics", "/tokenize"])
async def test_api_key_is_required_everywhere_but_health(
    path: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG")
    secret = "sk-very-secret-value"
    async with serving(make_app(api_key=secret)) as h:
        method = "GET" if path in ("/v1/models", "/metrics") else "POST"
        body = json.dumps(GOOD).encode()
        err = assert_error(await h.request(method, path, body=body), 401, None)
        assert err["code"] == "invalid_api_key"
        wrong = {"authorization": "Bearer sk-very-secret-valuE"}
        assert_error(await h.request(method, path, body=body, headers=wrong), 401, None)
        assert_error(await h.request(method, path, body=body,
                                     headers={"authorization": secret}), 401, None)
        ok = await h.request(method, path, body=body,
                             headers={"authorization": f"Bearer {secret}"})
        assert ok.status == 200, ok.body
        assert (await h.request("GET", "/health")).status == 200
    assert secret not in caplog.text
    assert "sekret" not in repr(ServerConfig("m", api_key="sekret"))


async def test_request_id_header_names_the_response_and_duplicates_are_refused() -> None:
    gate = GateClock()
    async with serving(make_app(clock=gate)) as h:
        stream = await h.open("POST", "/v1/completions", json_body={**GOOD, "stream": True},
                              headers={"x-request-id": "trace-42"})
        await trio.testing.wait_all_tasks_blocked()
        dup = await h.post("/v1/completions", GOOD, headers={"x-request-id": "trace-42"})
        assert_error(dup, 400, "X-Request-Id")
        bad = await h.post("/v1/completions", GOOD, headers={"x-request-id": "has space"})
        assert_error(bad, 400, "X-Request-Id")
        batch = await h.open("POST", "/v1/completions", headers={"x-request-id": "b"},
                             json_body={**GOOD, "prompt": ["x", "y"], "stream": True})
        await trio.testing.wait_all_tasks_blocked()
        # "cmpl-b-0" is the engine id of the batch's first prompt: refused, not a 500.
        clash = await h.post("/v1/completions", GOOD, headers={"x-request-id": "b-0"})
        assert_error(clash, 400, "request_id")
        gate.release(10)
        assert (await batch.read_all()).status == 200
        r = await stream.read_all()
        assert r.headers["x-request-id"] == "trace-42"
        assert all(json.loads(e)["id"] == "cmpl-trace-42" for e in r.events()[:-1])
        # Without the header, ids come from the app's counter, and `created` from its clock.
        body = (await h.post("/v1/completions", GOOD)).json()
        assert re.fullmatch(r"cmpl-\d+", body["id"])
        assert body["created"] == CREATED


async def test_queue_limit_answers_429_with_retry_after() -> None:
    gate = GateClock()
    engine = make_engine()
    async with serving(make_app(engine, clock=gate, max_queue=2)) as h:
        waiting = [await h.open("POST", "/v1/completions", json_body=GOOD) for _ in range(2)]
        await trio.testing.wait_all_tasks_blocked()
        with trio.fail_after(30):  # a deadlock guard: without the limit it would queue forever
            r = await h.post("/v1/completions", GOOD)
        err = assert_error(r, 429, None)
        assert err["code"] == "queue_full"
        assert r.headers["retry-after"] == "1"
        two = await h.post("/v1/completions", {**GOOD, "prompt": ["a", "b", "c"]})
        assert_error(two, 400, "prompt")  # more prompts than the queue can ever hold
        gate.release(4)  # both waiting requests run to their end (4 tokens each)
        assert [(await ex.read_all()).status for ex in waiting] == [200, 200]
        ok = await h.open("POST", "/v1/completions", json_body=GOOD)
        gate.release(4)
        assert (await ok.read_all()).status == 200
        assert gate.steps_run == 8


VLLM_FAMILIES = {  # vLLM's metric names (vllm/v1/metrics/loggers.py), with our prefix
    "num_requests_running": "gauge", "num_requests_waiting": "gauge",
    "kv_cache_usage_perc": "gauge", "prefix_cache_queries": "counter",
    "prefix_cache_hits": "counter", "num_preemptions": "counter", "prompt_tokens": "counter",
    "generation_tokens": "counter", "request_success": "counter",
    "time_to_first_token_seconds": "histogram", "inter_token_latency_seconds": "histogram",
    "e2e_request_latency_seconds": "histogram", "request_queue_time_seconds": "histogram",
}  # fmt: skip


async def test_metrics_exposition() -> None:
    """/metrics parses with prometheus_client's own parser, in both formats a Prometheus
    server may ask for, with vLLM's names, types and buckets."""
    async with serving(make_app()) as h:
        for n in (3, 5):
            assert (await h.post("/v1/completions", {**GOOD, "max_tokens": n})).status == 200
        text = (await h.request("GET", "/metrics")).body.decode()
        om = await h.request("GET", "/metrics", headers={
            "Accept": "application/openmetrics-text; version=1.0.0"})
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    assert om.body.decode().endswith("# EOF\n")
    for families in (text_string_to_metric_families(text),
                     openmetrics_parser.text_string_to_metric_families(om.body.decode())):
        ours = {f.name.removeprefix("nanoserve:"): f for f in families
                if f.name.startswith("nanoserve:")}
        assert {k: f.type for k, f in ours.items()} == VLLM_FAMILIES
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in ours.values() for s in f.samples}
        lbl = (("model_name", "stub"),)
        assert samples[("nanoserve:generation_tokens_total", lbl)] == 8
        assert samples[("nanoserve:prompt_tokens_total", lbl)] == 2 * 5  # "def step(self):"
        assert samples[("nanoserve:request_success_total",
                        (("finished_reason", "length"), ("model_name", "stub")))] == 2
        for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                     "request_queue_time_seconds"):
            assert samples[(f"nanoserve:{name}_count", lbl)] == 2
            assert samples[(f"nanoserve:{name}_bucket", (("le", "+Inf"), *lbl))] == 2
        assert samples[("nanoserve:inter_token_latency_seconds_count", lbl)] == 2 + 4
        ttft_bounds = [s.labels["le"] for s in ours["time_to_first_token_seconds"].samples
                       if s.name.endswith("_bucket")]
        assert [float(b) for b in ttft_bounds] == [*TTFT_BUCKETS, math.inf]
    names = {f.name for f in text_string_to_metric_families(text)}
    assert "process_resident_memory_bytes" in names  # the process collector, as vLLM's


async def test_speculative_decoding_counters_on_metrics_with_vllms_names() -> None:
    """Where the engine speculates, /metrics has vLLM's spec_decode families: on the copy
    workload of tests/test_speculative.py, 6 proposals of 17 tokens, 13 kept; none from a
    request with `"speculate": false`."""
    source = '{"name": "nanoserve", "version": 3, "license": "MIT"}'
    edit = source.replace('"version": 3', '"version": 4')
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2,
                             prompt_lookup_max=4)
    async with serving(make_app(make_engine(speculative=spec))) as h:
        body = {"model": "stub", "prompt": f"⟪say⟫{edit}⟪/say⟫ Rewrite this JSON with "
                f"version 4: {source}\n", "max_tokens": 60, "temperature": 0}
        assert (await h.post("/v1/completions", body)).json()["choices"][0]["text"] == edit
        # A request that opts out gets the same text and adds no proposal to the counts.
        off = (await h.post("/v1/completions", {**body, "speculate": False})).json()
        assert off["choices"][0]["text"] == edit
        assert_error(await h.post("/v1/completions", {**body, "speculate": "maybe"}), 400,
                     "speculate")
        text = (await h.request("GET", "/metrics")).body.decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    lbl = (("model_name", "stub"),)
    assert samples[("nanoserve:spec_decode_num_drafts_total", lbl)] == 6
    assert samples[("nanoserve:spec_decode_num_draft_tokens_total", lbl)] == 17
    assert samples[("nanoserve:spec_decode_num_accepted_tokens_total", lbl)] == 13
    assert [samples[("nanoserve:spec_decode_num_accepted_tokens_per_pos_total",
                     (("model_name", "stub"), ("position", str(i))))] for i in range(4)] == \
        [6, 4, 3, 0]


async def test_tokenize_detokenize_and_models_agree_with_usage() -> None:
    async with serving(make_app()) as h:
        tok = (await h.post("/tokenize", {"model": "stub", "prompt": "def step(self):",
                                          "return_token_strs": True})).json()
        assert tok["count"] == len(tok["tokens"]) == 5
        assert tok["max_model_len"] == 1024
        # The vocabulary's own strings (convert_ids_to_tokens), as vLLM's: "Ġ" is the space.
        assert tok["token_strs"] == ["def", "Ġstep", "(", "self", "):"]
        usage = (await h.post("/v1/completions", GOOD)).json()["usage"]
        assert usage["prompt_tokens"] == tok["count"]
        back = (await h.post("/detokenize", {"tokens": tok["tokens"]})).json()
        assert back == {"prompt": "def step(self):"}
        chat_tok = (await h.post("/tokenize", {"messages": CHAT["messages"]})).json()
        chat_usage = (await h.post("/v1/chat/completions", CHAT)).json()["usage"]
        assert chat_usage["prompt_tokens"] == chat_tok["count"]
        models = (await h.request("GET", "/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["stub"]
        assert models["data"][0]["max_model_len"] == 1024


async def test_echo_and_several_prompts() -> None:
    async with serving(make_app()) as h:
        body = {**GOOD, "prompt": ["def step(self):", "The quick"], "echo": True}
        r = (await h.post("/v1/completions", body)).json()
        assert [c["index"] for c in r["choices"]] == [0, 1]
        assert r["choices"][0]["text"].startswith("def step(self):")
        alone = (await h.post("/v1/completions", GOOD)).json()["choices"][0]["text"]
        assert r["choices"][0]["text"] == "def step(self):" + alone
        assert r["choices"][1]["text"].startswith("The quick")
        assert r["usage"] == {"prompt_tokens": 7, "completion_tokens": 8, "total_tokens": 15}
        ids = (await h.post("/v1/completions", {**body, "prompt": [[1, 2, 3], [4, 5]]})).json()
        assert ids["usage"]["prompt_tokens"] == 5
        assert ids["choices"][1]["text"].startswith(stub_parts()[1].decode([4, 5]))


async def test_health_is_503_while_loading_then_200() -> None:
    release = threading.Event()

    def loader() -> Engine:
        release.wait()
        return make_engine()

    app = make_app(loader)
    async with serving(app) as h:
        r = await h.request("GET", "/health")
        assert assert_error(r, 503, None)["code"] == "model_loading"
        assert_error(await h.post("/v1/completions", GOOD), 503, None)
        release.set()
        with trio.fail_after(30):
            await server_state(app).loaded.wait()
        assert (await h.request("GET", "/health")).status == 200
        await assert_serving(h)


async def test_failed_load_is_reported_and_fatal() -> None:
    failed = trio.Event()

    def loader() -> Engine:
        raise RuntimeError("no weights here")

    app = create_app(loader, ServerConfig("stub"), clock=StepClock(), time_source=lambda: 0.0,
                     on_fatal=lambda exc: failed.set())
    async with serving(app) as h:
        with trio.fail_after(30):
            await failed.wait()
        err = assert_error(await h.request("GET", "/health"), 503, None)
        assert err["code"] == "model_load_failed"
        assert "no weights here" in err["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_continuous_usage_stats_puts_usage_on_every_chunk(path: str) -> None:
    """vLLM's `stream_options.continuous_usage_stats` (GuideLLM sends it): with
    include_usage, every chunk carries its choice's prompt tokens and the tokens generated
    so far, and the usage chunk still ends the stream; without include_usage, nothing."""
    base = GOOD if path == "/v1/completions" else CHAT
    body = {**base, "max_tokens": 6, "n": 2, "temperature": 1.0, "seed": 3,
            "ignore_eos": True, "stream": True}
    async with serving(make_app()) as h:
        on = {"include_usage": True, "continuous_usage_stats": True}
        events = (await h.post(path, {**body, "stream_options": on})).events()
        unary = (await h.post(path, {**body, "stream": False})).json()
        alone = (await h.post(path, {**body, "stream_options": {
            "continuous_usage_stats": True}})).events()
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]"
    *per_token, last = chunks
    prompt = unary["usage"]["prompt_tokens"]
    counts = {0: 0, 1: 0}
    for c in per_token:
        (choice,) = c["choices"]
        u, i = c["usage"], choice["index"]
        # A chunk per token, except tokens whose text is held back (part of a character).
        assert u["completion_tokens"] > counts[i]
        counts[i] = u["completion_tokens"]
        assert u == {"prompt_tokens": prompt, "completion_tokens": counts[i],
                     "total_tokens": prompt + counts[i]}
        assert (choice["finish_reason"] is not None) == (counts[i] == 6)
    assert counts == {0: 6, 1: 6}
    assert last["choices"] == []
    assert last["usage"] == unary["usage"]
    assert unary["usage"]["completion_tokens"] == 12
    assert all("usage" not in json.loads(e) for e in alone[:-1])  # as vLLM: needs include_usage
