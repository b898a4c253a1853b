"""One request (one sequence) as the engine tracks it, and the updates it hands out.

The engine has no prefill or decode phase: a request is a token list and a count of how
many of them are in the KV cache (`num_computed`). Whatever is past that count is work the
scheduler can hand out, a whole prompt, a chunk of one, or the one token sampled last step.
"""

from __future__ import annotations

import enum
from collections.abc import Container
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from nanoserve.sampling.params import ParamError

if TYPE_CHECKING:
    from nanoserve.engine.detokenizer import IncrementalDetokenizer
    from nanoserve.sampling.params import SamplingParams
    from nanoserve.sampling.sampler import TokenLogprobs


def check_unused(request_id: str, in_flight: Container[str]) -> None:
    """Raise the ParamError (field `request_id`) that refuses an id already in flight: the one
    rule, asked by each holder of ids (the engine of its requests, the bridge of those it has
    accepted and not yet admitted, the HTTP registry of its public ids)."""
    if request_id in in_flight:
        raise ParamError("request_id", f"request id {request_id!r} is already in flight")


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"
    ERROR = "error"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str  # unique inside the engine: the group's id, plus "#i" for child i > 0
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: the params' max_tokens, or the rest of the context
    seed: int  # effective sampling seed (the request's own, or derived from the engine's)
    admission: int  # admission number, in arrival order
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_cached_prompt: int = 0  # prompt tokens served by the prefix cache on admission
    blocks: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # names of the full blocks, in order
    # The names (kv.chain_hash) of token_ids' first full blocks, as far as they have been
    # computed: a function of the tokens alone, which only grow, so it outlives a preemption
    # (a request waiting for room is looked up again every step).
    chain: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    detok: IncrementalDetokenizer | None = None
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    num_preemptions: int = 0
    first_token_step: int | None = None
    group: str = ""  # the id the caller knows; all n completions of a prompt share it
    index: int = 0  # which of the n completions this is
    # Completions not yet forked from this one: they come into being, sharing its prompt
    # blocks, at the step that computes its last prompt token.
    pending_children: int = 0
    # With params.prompt_logprobs: one entry per prompt token computed so far, None for the
    # first (nothing precedes it). Kept across preemption, so a recompute adds none twice.
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    # params.guided's matcher (nanoserve/sampling/grammar.py), made when the request first samples
    grammar: Any = None
    # Tokens proposed to follow token_ids, checked this step (engine/speculative.py); only
    # ever set from a step's proposals to its end.
    draft: list[int] = field(default_factory=list)
    # The chance that a proposed token is kept, as this request's proposals have gone
    # (engine/speculative.py's policy); starts at its PRIOR, 0.5.
    spec_rate: float = 0.5

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)
        if not self.group:
            self.group = self.request_id

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt logprobs are asked for and not all computed yet."""
        return (
            self.params.prompt_logprobs is not None
            and len(self.prompt_logprobs) < len(self.prompt_ids)
        )

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids) :]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


class Update(NamedTuple):
    """What one step did for one request. Carries copies, never the live request.

    A NamedTuple, immutable as a frozen dataclass is but made in a third of the time: the
    engine makes one for every token of every request (14% of a simulation's time went to
    the frozen dataclass's __init__)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    text: str  # text released by this step (held-back characters come later)
    # Which of the request's n completions this is (the field hides tuple.index, which
    # nothing calls on an Update).
    index: int = 0  # type: ignore[assignment]
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    # The request field the error is the fault of (a constraint the engine found it cannot
    # follow): the server answers it as a 400 naming the field, not as an engine failure.
    error_param: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: tuple[TokenLogprobs | None, ...] = ()
    # The prompt's logprobs (first entry None), on the update carrying the first output
    # token, when params.prompt_logprobs asked for them; None on every other update.
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None


class Endings:
    """Which of one request's n completions have had their final update: the one rule for
    "this completion has ended" and "this request has ended".

    Each reader of a request's updates holds one and asks it, at its own point along the
    way: the bridge's ledger as it routes updates, the RequestStream as it reads them, the
    HTTP job as its handler consumes them, the OutputBuilder as it folds them. They are not
    one count shared, because an update reaches them at different times (the ledger has
    routed a final update its reader has not read yet)."""

    __slots__ = ("n", "_ended")

    def __init__(self, n: int) -> None:
        self.n = n
        self._ended: set[int] = set()

    def note(self, update: Update) -> bool:
        """Count `update`; True when it is the final update of a completion not ended before."""
        if not update.finished or update.index in self._ended:
            return False
        self._ended.add(update.index)
        return True

    def __contains__(self, index: int) -> bool:
        """Whether completion `index` has ended."""
        return index in self._ended

    @property
    def all(self) -> bool:
        """Whether every completion has ended (the request has)."""
        return len(self._ended) >= self.n

    @property
    def open(self) -> int:
        """How many completions have not ended."""
        return self.n - len(self._ended)
