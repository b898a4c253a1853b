"""Speculative decoding: tokens proposed for a sequence, checked in the step's one forward.

A decoding request normally computes one token a step: its last, whose logits give the
next. With a proposal d_1..d_k it computes k + 1 (its last and the proposal) in the same
forward, as k + 1 decode rows of one sequence (batch.py: row j's context ends at its own
position), and so gets the logits after each of them. The step then draws a
token from each of those k + 1 rows exactly as it would have drawn it without the
proposal: with the same sampler, the same row state (penalties see the proposal's tokens
before each row as output), and the same uniform, which depends only on (seed, index of
the token in the output) (sampling/sampler.py). Row j's draw t_j stands only if every
proposed token before it matched: t_0 is always taken, t_j for j >= 1 only while
t_0..t_{j-1} equal d_1..d_j. What comes out is the tokens decoding one at a time would
have drawn, token for token, at any temperature and with any seed, given the same
logits rows.

That is the rejection sampling of Leviathan et al. for a proposal that is a function of
the context (n-gram lookup; a draft model's greedy pick): its q puts all its mass on d, so
d is kept with probability min(1, p(d) / q(d)) = p(d), the chance that a draw from p is d,
and when it is not, the draw is from p without d, renormalised: the residual
max(0, p - q) the algorithm samples from. So the output has the target's distribution.

The rest of the step follows from the count of tokens kept (proposals.py): the request's KV
holds its last token and the proposal tokens that matched, the slots of the others are
overwritten later, and the blocks wholly past them go back to the pool at once.

Which requests get a proposal, and how long, is the policy below (proposal_length): a
request proposes as many tokens as its own record of kept tokens says pay for the rows
they add, and none where none pays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from nanoserve.engine.outputs import SpecStats

if TYPE_CHECKING:
    from nanoserve.engine.request import Request


def ngram_proposal(tokens: Sequence[int], k: int, low: int, high: int) -> list[int]:
    """Up to `k` tokens that followed an earlier occurrence of the longest n-gram (`low` <=
    n <= `high`) that ends `tokens`: the latest occurrence with k tokens after it, else the
    first (the one with the most); none where no such n-gram occurs before."""
    size = len(tokens)
    if k < 1 or size < low + 1:
        return []
    seq = np.asarray(tokens, dtype=np.int64)
    # Where an earlier n-gram can end: the positions before the last whose token is the last.
    ends = np.flatnonzero(seq[:-1] == seq[-1])
    for n in range(min(high, size - 1), low - 1, -1):
        cand = ends[ends >= n - 1]
        for back in range(1, n):  # compare the rest of the n-gram, one position at a time
            if cand.size == 0:
                break
            cand = cand[seq[cand - back] == seq[size - 1 - back]]
        if cand.size:
            full = cand[cand + k < size]
            start = int(full[-1] if full.size else cand[0]) + 1
            return seq[start:start + k].tolist()
    return []


# What one more checked row costs a batch-1 step, as a share of the step: SmolLM2's
# projections on AVX-512, one call each at 1 to 5 rows (us): qkv 26 32 38 44 49, gate_up 66
# 85 104 123 141, down 34 41 49 57 66, so about a quarter a row (the weights are read once;
# each row adds its multiply-adds).
ROW_COST = 0.25
# A request's estimate of the chance that a proposed token is kept: where it starts, how
# fast it follows what its proposals did, and how fast it drifts back to the start while
# it proposes nothing (so that text which turns to copying is tried again).
PRIOR, FOLLOW, DRIFT = 0.5, 0.3, 0.05


def proposal_length(rate: float, most: int) -> int:
    """The proposal length that pays best at a kept-token chance of `rate`: k tokens give
    (1 - rate^(k+1)) / (1 - rate) tokens a step (each kept only after all before it) for
    a step that costs 1 + ROW_COST k; 0 where no length beats decoding one token."""
    a = min(max(rate, 0.0), 0.95)
    best, gain = 0, 1.0
    for k in range(1, most + 1):
        g = (1 - a ** (k + 1)) / (1 - a) / (1 + ROW_COST * k)
        if g > gain:
            best, gain = k, g
    return best


def follow(rate: float, proposed: int, kept: int) -> float:
    """The estimate after a proposal of `proposed` tokens of which the first `kept` were
    kept: each kept token a success, the one that was not a failure."""
    seen = kept / (kept + 1) if kept < proposed else 1.0
    return rate + FOLLOW * (seen - rate)


def speculates(req: Request) -> bool:
    """Whether a decoding request may get a proposal: not while it owes prompt logprobs or
    unforked completions, nor where the request opted out (SamplingParams.speculate), nor
    where its constraint has no matcher yet (it gets one at its first draw)."""
    p = req.params
    return (p.speculate and not req.needs_prompt_logprobs and not req.pending_children
            and (p.guided is None or req.grammar is not None))


def allowed_prefix(req: Request, proposal: list[int]) -> list[int]:
    """The longest start of `proposal` that the request's constraint allows after its
    output so far (all of it where it has none): a proposal is cut where its constraint
    would refuse it, before any row checks it."""
    if req.grammar is None or not proposal:
        return proposal
    return proposal[:req.grammar.validate_tokens(proposal)]


@dataclass(slots=True)
class SpecCounters:
    """vLLM's counters of speculative decoding: proposals checked (`drafts`), their tokens,
    the tokens kept, and the tokens kept at each position of a proposal (index 0: first)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def count(self, requests: Sequence[Request], tokens_kept: Sequence[list[int]]) -> int:
        """Count a step's checked proposals (each request's, with the tokens it kept);
        returns the proposed tokens kept."""
        kept_all = 0
        for req, tokens in zip(requests, tokens_kept, strict=True):
            if not req.draft:
                continue
            kept = len(tokens) - 1
            self.drafts += 1
            self.draft_tokens += len(req.draft)
            kept_all += kept
            while len(self.accepted_per_position) < len(req.draft):
                self.accepted_per_position.append(0)
            for i in range(kept):
                self.accepted_per_position[i] += 1
        self.accepted_tokens += kept_all
        return kept_all

    def stats(self) -> SpecStats:
        return SpecStats(self.drafts, self.draft_tokens, self.accepted_tokens,
                         tuple(self.accepted_per_position))
