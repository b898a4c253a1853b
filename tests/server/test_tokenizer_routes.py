"""`/tokenize`'s token strings and `/tokenizer_info`, as vLLM answers them, on the stub model
(whose tokenizer is SmolLM2's, a byte-level BPE)."""

from __future__ import annotations

import time

from support.http_harness import serving, stub_parts
from support.server_harness import CREATED, make_app
from transformers import PreTrainedTokenizerFast

from nanoserve.model.loader import resolve_model

SECRET = "sk-tokenizer-info"


async def test_token_strs_are_the_vocabularys_own_strings() -> None:
    hf = PreTrainedTokenizerFast(tokenizer_file=str(resolve_model("smollm2") / "tokenizer.json"))
    async with serving(make_app()) as h:
        for text, strs in (("The sky is blue", ["The", "Ġsky", "Ġis", "Ġblue"]),
                           # a split character: each piece is a vocabulary entry all the same
                           ("a😀", ["a", "ðŁ", "ĺ", "Ģ"])):
            r = (await h.post("/tokenize", {"prompt": text, "return_token_strs": True})).json()
            assert r["token_strs"] == strs
            # transformers' convert_ids_to_tokens, which vLLM calls, and back to the ids.
            assert hf.convert_ids_to_tokens(r["tokens"]) == strs
            assert hf.convert_tokens_to_ids(strs) == r["tokens"]
        r = (await h.post("/tokenize", {"prompt": "The sky"})).json()
        assert r["token_strs"] is None


async def test_tokenizer_info_is_the_tokenizers_config_and_chat_template() -> None:
    _, tok = stub_parts()
    async with serving(make_app()) as h:
        r = await h.request("GET", "/tokenizer_info")
        assert r.status == 200, r.body
        assert r.json() == {
            "backend": "tokenizers", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
            "model_max_length": 8192, "pad_token": "<|im_end|>",
            "tokenizer_class": "TokenizersBackend", "unk_token": "<|endoftext|>",
            "chat_template": tok.chat_template,
        }
        assert "{% for message in messages %}" in tok.chat_template
    # The server's own template (--chat-template) is the one it renders with: that one.
    async with serving(make_app(chat_template="{{ messages[0]['content'] }}")) as h:
        info = (await h.request("GET", "/tokenizer_info")).json()
        assert info["chat_template"] == "{{ messages[0]['content'] }}"


async def test_tokenizer_info_needs_the_key() -> None:
    async with serving(make_app(api_key=SECRET)) as h:
        r = await h.request("GET", "/tokenizer_info")
        assert r.status == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
        r = await h.request("GET", "/tokenizer_info",
                            headers={"authorization": f"Bearer {SECRET}"})
        assert r.status == 200
        assert r.json()["tokenizer_class"] == "TokenizersBackend"


async def test_a_templates_date_is_the_apps_clock() -> None:
    # Llama 3.x's template puts strftime_now's date in its header; the app's injected clock
    # (fixed here, CREATED) is the one it reads, so a replay renders the same prompt any day.
    template = "{{ strftime_now('%d %b %Y') }}|{{ messages[0]['content'] }}"
    day = time.strftime("%d %b %Y", time.localtime(CREATED))
    async with serving(make_app(chat_template=template)) as h:
        body = {"messages": [{"role": "user", "content": "hi"}]}
        ids = (await h.post("/tokenize", body)).json()["tokens"]
        assert stub_parts()[1].decode(ids) == f"{day}|hi"
        # the chat route renders the same prompt: its prompt tokens are those ids
        r = await h.post("/v1/chat/completions", {**body, "model": "stub", "max_tokens": 1,
                                                  "prompt_logprobs": 0})
        scored = r.json()["prompt_logprobs"]
        assert [int(next(iter(e))) for e in scored[1:]] == ids[1:]
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
