"""What the engine hands out: each request's Update, each step's result, its statistics, and
final results.

An `Update` is what one step did for one request (`token_update`, or `final_update` for its
last). `StepResult` is what one `Engine.step()` did (its updates, and the work counts a cost model
prices); `EngineStats` the engine's counters. Final results are built from a request's
updates, in the shape of vLLM's RequestOutput: both the offline `LLM` and the async bridge
fold updates through `OutputBuilder`, so a streamed request and a unary one end in the same
object by construction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from nanoserve.engine.request import Endings, FinishReason, Request, Update
from nanoserve.sampling.sampler import TokenLogprobs


@dataclass(frozen=True, slots=True)
class StepResult:
    step: int
    updates: tuple[Update, ...]
    preempted: tuple[str, ...]
    num_prefill_tokens: int
    num_decode_tokens: int
    # What a step-cost model needs beyond token counts (sim/capacity/cost.py): rows in prefill, and
    # the attention work as (query, key) pairs: a decode row attends to its whole context,
    # a prefill chunk [start, end) causally to sum(p + 1 for p in range(start, end)); of
    # those, the pairs with keys already in the cache (the chunk's rows x start), which a
    # continuation chunk reads back through its block table.
    num_prefill_seqs: int = 0
    decode_context: int = 0
    prefill_attention: int = 0
    prefill_cached_pairs: int = 0
    # Speculative decoding (engine/speculative.py): proposed tokens checked, and of those
    # kept; num_decode_tokens counts the rows, each checked token's included.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass(frozen=True, slots=True)
class SpecStats:
    """Speculative decoding's counters (engine/speculative.py), vLLM's: proposals checked,
    their tokens, the tokens kept, and those kept at each position of a proposal."""

    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class EngineStats:
    steps: int
    running: int
    waiting: int
    num_blocks: int
    free_blocks: int
    peak_used_blocks: int
    preemptions: int
    prefill_tokens: int
    decode_tokens: int
    prefix_queries: int
    prefix_hits: int
    finished: int
    aborted: int  # caller's requests abort_request ended (counters.py's aborted_groups)
    failed: int
    spec: SpecStats | None = None  # None: the engine does not speculate


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


class OutputBuilder:
    """Folds one request's updates (of all its n children) into a RequestOutput."""

    def __init__(self, request_id: str, prompt_ids: Sequence[int], n: int = 1) -> None:
        self.request_id = request_id
        self.prompt_ids = tuple(prompt_ids)
        self._acc = [_Acc() for _ in range(n)]
        self._endings = Endings(n)
        self.num_cached_tokens = 0
        self.prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None

    def add(self, u: Update) -> None:
        a = self._acc[u.index]
        a.token_ids.extend(u.new_token_ids)
        a.text.append(u.text)
        a.logprobs.extend(u.logprobs)
        if u.prompt_logprobs is not None:  # every completion carries the same ones
            self.prompt_logprobs = u.prompt_logprobs
        if self._endings.note(u):
            a.finish_reason, a.stop_reason, a.error = u.finish_reason, u.stop_reason, u.error
            self.num_cached_tokens = max(self.num_cached_tokens, u.num_cached_tokens)

    @property
    def finished(self) -> bool:
        return self._endings.all

    def build(self) -> RequestOutput:
        outs = tuple(
            CompletionOutput(i, tuple(a.token_ids), "".join(a.text), a.finish_reason,
                             a.stop_reason, tuple(a.logprobs), a.error)
            for i, a in enumerate(self._acc)
        )
        return RequestOutput(self.request_id, self.prompt_ids, outs, self.num_cached_tokens,
                             self.prompt_logprobs)


# -- the Update of one request's step: built from the Request's state after the engine has
# applied the token; copies only, so an Update never aliases the live request.


def prompt_logprobs_update(req: Request) -> tuple[TokenLogprobs | None, ...] | None:
    """The prompt's logprobs, on the update of the first output token only."""
    if req.params.prompt_logprobs is None or req.num_output != 1:
        return None
    return tuple(req.prompt_logprobs)


def token_update(req: Request, tokens: tuple[int, ...], text: str,
                 logprobs: tuple[TokenLogprobs | None, ...]) -> Update:
    """A request that goes on: its new tokens (one, or more with a proposal), the text
    they released, and their logprobs."""
    return Update(
        req.group,
        tokens,
        text,
        index=req.index,
        num_prompt_tokens=req.num_prompt,
        num_output_tokens=req.num_output,
        num_cached_tokens=req.num_cached_prompt,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs_update(req),
    )


def final_text(req: Request) -> str:
    """The text a finishing completion releases: all its detokenizer still held back."""
    if req.detok is None:
        return ""
    try:
        return req.detok.pop_delta() + req.detok.finish()
    except Exception:  # the request is already failing; keep its error
        return ""


def final_update(req: Request, reason: FinishReason, new_tokens: tuple[int, ...], text: str,
                 stop_reason: int | str | None, error: str | None,
                 error_param: str | None = None) -> Update:
    """A completion's last update: its last tokens (none for an abort) and all held text."""
    return Update(
        req.group,
        new_tokens,
        text,
        index=req.index,
        finished=True,
        finish_reason=reason.value,
        stop_reason=stop_reason,
        error=error,
        error_param=error_param,
        num_prompt_tokens=req.num_prompt,
        num_output_tokens=req.num_output,
        num_cached_tokens=req.num_cached_prompt,
        logprobs=tuple(req.logprobs[-len(new_tokens) :]) if new_tokens else (),
        prompt_logprobs=prompt_logprobs_update(req) if new_tokens else None,
    )


def empty_final(request_id: str, index: int, reason: FinishReason, error: str | None,
                num_prompt_tokens: int) -> Update:
    """The last update of a completion that ends without a token of its own: one never
    forked (its parent ended first), or one the bridge ends (aborted before admission, the
    loop gone, shutdown)."""
    return Update(request_id, (), "", index=index, finished=True, finish_reason=reason.value,
                  error=error, num_prompt_tokens=num_prompt_tokens)
