"""The offline API a vLLM user already knows: `LLM(...).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nanoserve.config import EngineConfig
from nanoserve.engine import Engine
from nanoserve.model import Model, load
from nanoserve.sampler import TokenLogprobs
from nanoserve.sampling import SamplingParams
from nanoserve.tokenizer import Tokenizer

Prompt = str | Sequence[int]


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    index: int
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: tuple[TokenLogprobs | None, ...] = ()


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """One prompt's result; `outputs` lists its n completions in index order, and
    `token_ids`, `text` and `finish_reason` are the first completion's (as in vLLM)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    num_cached_tokens: int = 0

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@dataclass(slots=True)
class _Acc:
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cached: int = 0


class LLM:
    def __init__(
        self,
        model: str = "smollm2",
        *,
        device: str = "cpu",
        dtype: str = "float32",
        stub_eos_prob: float = 0.0,
        **engine_kwargs: Any,
    ) -> None:
        m, tok = load(model, device=device, dtype=dtype, stub_eos_prob=stub_eos_prob)
        self.engine = Engine(m, tok, EngineConfig(**engine_kwargs))

    @classmethod
    def from_parts(cls, model: Model, tokenizer: Tokenizer, config: EngineConfig) -> LLM:
        self = cls.__new__(cls)
        self.engine = Engine(model, tokenizer, config)
        return self

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion in one continuous batch; results in prompt order."""
        plist: list[Prompt]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            plist = [prompts]  # type: ignore[list-item]
        else:
            plist = list(prompts)  # type: ignore[arg-type]
        if params is None:
            params = SamplingParams()
        per = list(params) if isinstance(params, Sequence) else [params] * len(plist)
        if len(per) != len(plist):
            raise ValueError(f"{len(plist)} prompts but {len(per)} SamplingParams")
        ids = [self.engine.add_request(p, sp) for p, sp in zip(plist, per, strict=True)]
        acc = {rid: _Acc() for rid in ids}
        while self.engine.has_unfinished():
            for u in self.engine.step().updates:
                a = acc[u.request_id]
                a.token_ids.extend(u.new_token_ids)
                a.text.append(u.text)
                a.logprobs.extend(u.logprobs)
                if u.finished:
                    a.finish_reason, a.stop_reason = u.finish_reason, u.stop_reason
                    a.cached = u.num_cached_tokens
        return [self._output(rid, p, acc[rid]) for rid, p in zip(ids, plist, strict=True)]

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        params: SamplingParams | None = None,
    ) -> RequestOutput:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate(prompt, params)[0]

    def _output(self, rid: str, prompt: Prompt, a: _Acc) -> RequestOutput:
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        out = CompletionOutput(
            0, tuple(a.token_ids), "".join(a.text), a.finish_reason, a.stop_reason,
            tuple(a.logprobs),
        )
        return RequestOutput(rid, tuple(prompt_ids), (out,), a.cached)
