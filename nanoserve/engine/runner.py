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
from nanoserve.sampling.sampler import SamplingRow, TokenLogprobs, sample


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
    tokens: list[list[int]]  # [R] each request's tokens kept: one, or more with a proposal
    logprobs: list[list[TokenLogprobs | None]]  # [R] theirs

    def draws(self) -> zip[tuple[Request, list[int], list[TokenLogprobs | None]]]:
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
            keep = [row + j for row, r in zip(b.sample_rows, b.samplers, strict=True)
                    for j in range(1 + len(r.draft))]
            logits = logits[torch.tensor(keep, dtype=torch.long, device=logits.device)]
        return Forwarded(advance(schedule, self.kv), b.samplers, logits, direct)

    def sample(self, fwd: Forwarded, rows: list[tuple[int, Request]]) -> Ran:
        """The draws for each (sampler, request) of `rows`: one, or with a proposal one
        after each of its tokens, of which the first that differs from the proposal ends
        what is kept (engine/speculative.py)."""
        if not any(r.draft for r in fwd.samplers):
            return self._one_each(fwd, rows)
        first: list[int] = []  # each sampler's first row in fwd's logits
        at = 0
        for r in fwd.samplers:
            first.append(at)
            at += 1 + len(r.draft)
        # (logits row, request, index of the draw in the request's output, output before
        # it, the constraint's mask there)
        draws = [(first[i] + j, r, r.num_output + j, r.draft[:j], mask)
                 for i, r in rows for j, mask in enumerate(self._masks(r))]
        if fwd.direct is not None:
            tokens = [fwd.direct[row] for row, *_ in draws]
            logprobs: Sequence[TokenLogprobs | None] = [None] * len(draws)
        else:
            logits = fwd.logits
            wanted = [row for row, *_ in draws]
            if wanted != list(range(len(logits))):  # forked siblings draw from their parent's
                logits = logits[torch.tensor(wanted, device=logits.device)]
            drawn = sample(logits, [SamplingRow(r.params, r.seed, index, r.prompt_ids,
                                                [*r.output_ids, *ahead], mask)
                                    for _, r, index, ahead, mask in draws], self.eos_token_ids)
            tokens, logprobs = drawn.token_ids, drawn.logprobs
        kept: list[list[int]] = []
        kept_lp: list[list[TokenLogprobs | None]] = []
        d = 0
        for _, r in rows:
            n = 1
            while n <= len(r.draft) and tokens[d + n - 1] == r.draft[n - 1]:
                n += 1
            kept.append(tokens[d:d + n])
            kept_lp.append(list(logprobs[d:d + n]))
            d += 1 + len(r.draft)
        return Ran(fwd.work, [r for _, r in rows], kept, kept_lp)

    def _one_each(self, fwd: Forwarded, rows: list[tuple[int, Request]]) -> Ran:
        """`sample` where no request has a proposal: one draw a request."""
        reqs = [r for _, r in rows]
        if fwd.direct is not None:
            return Ran(fwd.work, reqs, [[fwd.direct[i]] for i, _ in rows],
                       [[None] for _ in rows])
        logits = fwd.logits
        if len(rows) > len(fwd.samplers):  # forked siblings draw from their parent's row
            logits = logits[torch.tensor([i for i, _ in rows], device=logits.device)]
        one = sample(logits, [SamplingRow(r.params, r.seed, r.num_output, r.prompt_ids,
                                          r.output_ids, self._mask(r)) for r in reqs],
                     self.eos_token_ids)
        return Ran(fwd.work, reqs, [[t] for t in one.token_ids],
                   [[lp] for lp in one.logprobs])

    def _masks(self, r: Request) -> list[bytes | None]:
        """A request's constraint masks for its draws this step: before its proposal and
        after each of its tokens (the matcher walked through them, then back: the tokens
        kept are taken in by the engine, as any drawn token is). The proposal holds only
        tokens the constraint allows (proposals.propose cut it)."""
        first = self._mask(r)
        if r.grammar is None:
            return [first] * (1 + len(r.draft))
        masks = [first]
        for token in r.draft:
            if not r.grammar.consume_token(token):
                raise RuntimeError(f"{r.request_id}: a proposed token {token} breaks its "
                                   "constraint")
            masks.append(r.grammar.compute_bitmask())
        r.grammar.rollback(len(r.draft))
        return masks

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
