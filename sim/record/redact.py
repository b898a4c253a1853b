"""`serve --record-redact`: a recorded trace's prompts replaced by text of the same length.

What a trace is for, replaying the load a server saw, needs each prompt's token count, not
its words; so every prompt string and chat message content becomes synthetic text of exactly
as many tokens (`sim.load.azure.PromptSynth`: pool words, one token each), and a token-id prompt
becomes the ids of such text (ids reveal content as much as text does). Equal contents
become equal text, so a system prompt that many requests share still shares its KV blocks in
a replay; partial overlaps (a common prefix of two different prompts) are not kept.

The words are drawn from a generator seeded per recording from the OS, never from the
content, so nobody can test a guess of a prompt against the trace. Other fields (stop
strings, logit_bias, user) are left as they are, and a redacted trace has no expectation
lines: the outputs, and the token ids in them, belong to the private prompts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from collections.abc import Sequence
from typing import Any

from nanoserve.tokenizer import Tokenizer
from sim.load.azure import PromptSynth
from sim.trace.format import TraceRequest


class Redactor:
    def __init__(self, tokenizer: Tokenizer, seed: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.synth = PromptSynth(tokenizer)
        self._rng = random.Random(os.urandom(16) if seed is None else seed)
        self._texts: dict[str, str] = {}
        self._ids: dict[tuple[int, ...], list[int]] = {}

    def text(self, original: str) -> str:
        """Synthetic text of the same token count; the same for equal originals."""
        if original not in self._texts:
            n = len(self.tokenizer.encode(original))
            self._texts[original] = self.synth.check(self.synth.text(n, self._rng), n) if n else ""
        return self._texts[original]

    def ids(self, original: Sequence[int]) -> list[int]:
        """Token ids of synthetic text, as many as the original's; equal for equal ids."""
        key = tuple(original)
        if key not in self._ids:
            n = len(key)
            self._ids[key] = list(self.tokenizer.encode(self.synth.check(
                self.synth.text(n, self._rng), n)))
        return list(self._ids[key])

    def body(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        out = dict(body)
        if path.endswith("/chat/completions"):
            messages = body.get("messages")
            if isinstance(messages, list):
                out["messages"] = [self._message(m) for m in messages]
        elif "prompt" in body:
            out["prompt"] = self._prompt(body["prompt"])
        return out

    def _prompt(self, prompt: Any) -> Any:
        if isinstance(prompt, str):
            return self.text(prompt)
        if isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt):
            return self.ids(prompt)
        if isinstance(prompt, list):
            return [self._prompt(p) for p in prompt]
        return prompt  # not a prompt the server accepts: nothing to hide, keep the error

    def _message(self, message: Any) -> Any:
        if not isinstance(message, dict):
            return message
        out = dict(message)
        content = message.get("content")
        if isinstance(content, str):
            out["content"] = self.text(content)
        elif isinstance(content, list):
            out["content"] = [
                {**part, "text": self.text(part["text"])}
                if isinstance(part, dict) and isinstance(part.get("text"), str) else part
                for part in content
            ]
        return out


def redact_requests(requests: Sequence[TraceRequest], tokenizer: Tokenizer,
                    seed: int | None = None) -> list[TraceRequest]:
    r = Redactor(tokenizer, seed)
    return [out for req in requests if (out := redact_request(r, req)) is not None]


def redact_request(r: Redactor, req: TraceRequest) -> TraceRequest | None:
    """The request with its prompts redacted. A body kept as bytes (one strict JSON cannot
    hold, which the server refused) is redacted as what a lenient parse made of it, and
    written back the way the client wrote it (NaN as NaN, a lone surrogate escaped); one
    whose prompt cannot even be tokenized, or that is no object at all (where no prompt
    can be told from the rest), is left out (None) rather than kept verbatim."""
    if req.raw_body is None:
        return dataclasses.replace(req, body=r.body(req.path, req.body))
    if not req.body:
        return None
    try:
        body = r.body(req.path, req.body)
    except Exception:
        return None
    raw = json.dumps(body, ensure_ascii=True, allow_nan=True).encode()
    return dataclasses.replace(req, body=body, raw_body=raw)


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
