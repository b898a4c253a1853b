"""`echo` of a prompt that holds special tokens, on the stub model: exact text and logprobs,
unary and streamed, the stream adding up to the unary."""

from __future__ import annotations

import json
from typing import Any

from http_harness import serving
from server_harness import make_app

EOT = "<|endoftext|>"  # token 0, a special token of SmolLM2's vocabulary


def chunks_of(r: Any) -> list[dict[str, Any]]:
    assert r.status == 200, r.body
    events = r.events()
    assert events[-1] == "[DONE]"
    return [json.loads(ev) for ev in events[:-1]]


def by_choice(chunks: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for ch in chunks:
        for c in ch["choices"]:
            out.setdefault(c["index"], []).append(c)
    return out


async def echo(h: Any, body: dict[str, Any]) -> dict[str, Any]:
    """The unary choice, after checking that the stream adds up to it, logprobs included."""
    c: dict[str, Any] = (await h.post("/v1/completions", body)).json()["choices"][0]
    cs = by_choice(chunks_of(await h.post("/v1/completions", {**body, "stream": True})))[0]
    assert "".join(x["text"] for x in cs) == c["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for x in cs for v in x["logprobs"][key]] == c["logprobs"][key], key
    return c


async def test_echo_of_special_tokens_is_the_text_its_logprobs_describe() -> None:
    prompt = {"model": "stub", "prompt": [0, 0, 0, 0, 0], "echo": True, "logprobs": 1,
              "max_tokens": 3, "temperature": 0.0}
    async with serving(make_app()) as h:
        # Three "The" forced after the prompt: every token is in the text where
        # text_offset says, the echoed specials too.
        c = await echo(h, {**prompt, "logit_bias": {"504": 100}})
        assert c["text"] == EOT * 5 + "TheTheThe"
        assert c["logprobs"]["tokens"] == [EOT] * 5 + ["The"] * 3
        assert c["logprobs"]["text_offset"] == [0, 13, 26, 39, 52, 65, 68, 71]
        # skip_special_tokens is about generated text (vLLM's meaning): forced specials
        # after the prompt leave the text unless it is false; the echo keeps its own.
        forced = {**prompt, "logit_bias": {"0": 100}}
        c = await echo(h, forced)
        assert c["text"] == EOT * 5
        assert c["logprobs"]["tokens"] == [EOT] * 8
        c = await echo(h, {**forced, "skip_special_tokens": False})
        assert c["text"] == EOT * 8
        assert c["logprobs"]["text_offset"] == [13 * i for i in range(8)]
