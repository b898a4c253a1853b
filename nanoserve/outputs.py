"""Final results, built from a request's updates: the shape of vLLM's RequestOutput.

Both the offline `LLM` and the async bridge fold updates through `OutputBuilder`, so a
streamed request and a unary one end in the same object by construction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from nanoserve.request import Update
from nanoserve.sampler import TokenLogprobs


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    index: int
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: tuple[TokenLogprobs | None, ...] = ()
    error: str | None = None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """One prompt's result; `outputs` lists its n completions in index order, and
    `token_ids`, `text` and `finish_reason` are the first completion's (as in vLLM)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    num_cached_tokens: int = 0
    # With params.prompt_logprobs: one entry per prompt token, None for the first (vLLM's).
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def num_output_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


@dataclass(slots=True)
class _Acc:
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    finished: bool = False


class OutputBuilder:
    """Folds one request's updates (of all its n children) into a RequestOutput."""

    def __init__(self, request_id: str, prompt_ids: Sequence[int], n: int = 1) -> None:
        self.request_id = request_id
        self.prompt_ids = tuple(prompt_ids)
        self._acc = [_Acc() for _ in range(n)]
        self.num_cached_tokens = 0
        self.prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None

    def add(self, u: Update) -> None:
        a = self._acc[u.index]
        a.token_ids.extend(u.new_token_ids)
        a.text.append(u.text)
        a.logprobs.extend(u.logprobs)
        if u.prompt_logprobs is not None:  # every completion carries the same ones
            self.prompt_logprobs = u.prompt_logprobs
        if u.finished:
            a.finished = True
            a.finish_reason, a.stop_reason, a.error = u.finish_reason, u.stop_reason, u.error
            self.num_cached_tokens = max(self.num_cached_tokens, u.num_cached_tokens)

    @property
    def finished(self) -> bool:
        return all(a.finished for a in self._acc)

    def build(self) -> RequestOutput:
        outs = tuple(
            CompletionOutput(i, tuple(a.token_ids), "".join(a.text), a.finish_reason,
                             a.stop_reason, tuple(a.logprobs), a.error)
            for i, a in enumerate(self._acc)
        )
        return RequestOutput(self.request_id, self.prompt_ids, outs, self.num_cached_tokens,
                             self.prompt_logprobs)
