"""Running a schedule: the model's forward, prompt scoring, and the draw of each row's token.

The runner is the part of a step that touches tensors, in two calls with the engine's fork
between them. `forward`: build the batch, run the model (or take its greedy picks directly
when it offers them and every row is a plain argmax: the stub's fast path in simulation),
score prompt tokens, advance the computed counts. `sample`: one draw per (logits row,
request), the rows the engine hands back (an n > 1 request's forked siblings draw from
their parent's row). Whatever either raises, the engine contains to the step's own
requests.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from nanoserve.engine.batch import StepBatch, Work, advance, build_batch, plain_greedy, score_prompt
from nanoserve.engine.kv import KVManager
from nanoserve.engine.request import Request
from nanoserve.engine.scheduler import Schedule
from nanoserve.model.base import Model
from nanoserve.sampling.grammar import Grammars
from nanoserve.sampling.params import SamplingParams
from nanoserve.sampling.sampler import SampleOutput, SamplingRow, TokenLogprobs, sample


@dataclass(frozen=True, slots=True)
class Forwarded:
    """The model's pass over one schedule: its work, the requests that sample this step
    (one per logits row, in row order), and their logits, or the model's own greedy picks."""

    work: Work
    samplers: list[Request]
    logits: torch.Tensor  # [len(samplers), vocab]; empty when `direct`
    direct: list[int] | None


@dataclass(frozen=True, slots=True)
class Ran:
    """What the model did for one schedule: the work counts and one draw per request."""

    work: Work
    requests: list[Request]  # [R] in draw order
    tokens: list[int]  # [R]
    logprobs: Sequence[TokenLogprobs | None]  # [R]

    def draws(self) -> zip[tuple[Request, int, TokenLogprobs | None]]:
        return zip(self.requests, self.tokens, self.logprobs, strict=True)


class ModelRunner:
    def __init__(self, model: Model, kv: KVManager, block_size: int,
                 eos_token_ids: tuple[int, ...], grammars: Grammars) -> None:
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.eos_token_ids = eos_token_ids
        self.grammars = grammars

    def forward(self, schedule: Schedule,
                group_params: Mapping[str, SamplingParams]) -> Forwarded:
        b = build_batch(schedule, self.block_size, group_params)
        direct = self._pick_directly(b)
        logits = self.model.forward(b.forward) if direct is None else torch.empty(0)
        if b.prompt.rows:
            score_prompt(logits, b.prompt)
            logits = logits[torch.tensor(b.sample_rows, dtype=torch.long, device=logits.device)]
        return Forwarded(advance(schedule, self.kv), b.samplers, logits, direct)

    def sample(self, fwd: Forwarded, rows: list[tuple[int, Request]]) -> Ran:
        """One draw for each (logits row, request) of `rows`."""
        reqs = [r for _, r in rows]
        if fwd.direct is not None:
            return Ran(fwd.work, reqs, [fwd.direct[i] for i, _ in rows], [None] * len(rows))
        logits = fwd.logits
        if len(rows) > len(fwd.samplers):  # forked siblings draw from their parent's row
            logits = logits[torch.tensor([i for i, _ in rows], device=logits.device)]
        drawn = self._sample(logits, reqs)
        return Ran(fwd.work, reqs, drawn.token_ids, drawn.logprobs)

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> SampleOutput:
        rows = [SamplingRow(r.params, r.seed, r.num_output, r.prompt_ids, r.output_ids,
                            self._mask(r)) for r in reqs]
        return sample(logits, rows, self.eos_token_ids)

    def _mask(self, r: Request) -> bytes | None:
        """A constrained request's allowed tokens for its next draw. Its matcher is made at
        its first draw (an n > 1 sibling's too) from its output so far: none, or, should a
        request ever lose it, every token it has, replayed."""
        spec = r.params.guided
        if spec is None:
            return None
        if r.grammar is None:
            r.grammar = self.grammars.matcher(spec)
            if r.output_ids and not r.grammar.consume_tokens(list(r.output_ids)):
                raise RuntimeError(f"{r.request_id}: its output does not fit its constraint")
        mask: bytes = r.grammar.compute_bitmask()
        return mask

    def _pick_directly(self, b: StepBatch) -> list[int] | None:
        """The model's own greedy picks (one per logits row), when it offers them and every
        row would take a plain argmax: greedy, no logprobs, nothing that edits logits."""
        if b.prompt.rows or not all(plain_greedy(r.params) for r in b.samplers):
            return None
        return self.model.pick_greedy(b.forward)
