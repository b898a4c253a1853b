"""The server under test, as the checks address it, and the deterministic requests they share.

A deterministic request is temperature 0 with a seed: every OpenAI-compatible server should
then answer the same text whether it streams or not. The prompts are the project's hard
cases for a detokenizer (emoji with joiners and skin tones, CJK, Hangul, accented Latin),
plus one plain English prompt, each asked on /v1/completions and /v1/chat/completions. Each
pair (unary, stream) is sent once and kept: four checks read the same exchanges.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx

from sim.target import wire
from sim.target.wire import Seen

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"

PROMPTS = (
    ("emoji", "Copy this line, then write another like it: 😀🎉🔥 👍🏽 👨‍👩‍👧 🇯🇵 🏳️‍🌈"),
    ("cjk", "東京の天気は今日とても良いです。北京和上海也很好。続けてください:"),
    ("hangul", "안녕하세요, 오늘은 날씨가 좋습니다. 다음 문장을 계속하세요:"),
    ("accents", "Écris une phrase avec des accents: éèêëàâçñöüß œ æ. Réponse:"),
    ("plain", "The quick brown fox jumps over the lazy dog. Then the fox"),
)


@dataclass(frozen=True, slots=True)
class Pair:
    prompt: str  # the prompt's name in PROMPTS
    path: str
    unary: Seen
    stream: Seen


@dataclass(slots=True)
class Target:
    url: str
    client: httpx.AsyncClient
    model: str
    max_tokens: int = 48
    settle_s: float = 10.0  # how long a hung-up request may stay in the running set
    phase_timeout_s: float = 60.0  # the most a fast stream may take beside slow readers
    window_s: float = 20.0  # how long fast streams run beside slow (or eager) readers
    slots: int | None = None  # requests the server runs at once (--slots), where no gauge says
    api_key: str | None = None  # sent as a Bearer token (the client has it; raw sockets too)
    logprobs: bool = True  # the server answered a request with logprobs
    extra: dict[str, Any] = field(default_factory=dict)  # --extra-body, on every generation
    _pairs: list[Pair] | None = field(default=None, repr=False)

    def body(self, path: str, prompt: str, **extra: Any) -> dict[str, Any]:
        """A deterministic request for `prompt` on `path`; `extra` on top."""
        out: dict[str, Any] = {"model": self.model}
        if path == CHAT:
            out["messages"] = [{"role": "user", "content": prompt}]
        else:
            out["prompt"] = prompt
        out.update({"max_tokens": self.max_tokens, "temperature": 0, "seed": 1234})
        out.update(extra)
        out.update(self.extra)
        return out

    async def send(self, path: str, body: dict[str, Any] | bytes, **kw: Any) -> Seen:
        return await wire.send(self.client, self.url, path, body, **kw)

    async def pairs(self) -> list[Pair]:
        """Every prompt on both paths, unary then stream, sent one at a time (so each runs
        alone on the server), with logprobs where the server gives them."""
        if self._pairs is None:
            self._pairs = [await self._pair(name, text, path)
                           for path in (COMPLETIONS, CHAT) for name, text in PROMPTS]
        return self._pairs

    async def _pair(self, name: str, prompt: str, path: str) -> Pair:
        unary = await self.send(path, self.body(path, prompt, **self._logprobs(path)))
        if self.logprobs and unary.status is not None and 400 <= unary.status < 500:
            self.logprobs = False  # the server refuses logprobs: compare texts only
            unary = await self.send(path, self.body(path, prompt))
        stream = await self.send(path, self.body(
            path, prompt, stream=True, stream_options={"include_usage": True},
            **self._logprobs(path)))
        return Pair(name, path, unary, stream)

    def _logprobs(self, path: str) -> dict[str, Any]:
        if not self.logprobs:
            return {}
        return {"logprobs": True} if path == CHAT else {"logprobs": 1}
