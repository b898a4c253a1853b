"""The sampler's logits stages: pure tensor functions over a batch of rows [R, V].

Each takes the logits and per-row parameters as tensors [R] (or per-row lists where the
Python work is linear in the ids given, never in the vocabulary) and returns new logits;
a row with a stage's neutral value comes out bit-for-bit unchanged (sampler.py says why
that matters). They run in sampler.py's order: penalties, logit bias, suppression, then
temperature, top-k, top-p and min-p before the draw.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import torch

_NEG_INF = float("-inf")
_TOP_P_CANDIDATES = 1024  # see apply_top_p


def _flat(ids: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row id lists as (row index [N], token id [N]) for one scatter; Python work is
    linear in the number of ids, never in the vocabulary."""
    chain = itertools.chain.from_iterable
    rows = list(chain(itertools.repeat(r, len(t)) for r, t in enumerate(ids)))
    toks = list(chain(ids))
    return (
        torch.tensor(rows, dtype=torch.long, device=device),
        torch.tensor(toks, dtype=torch.long, device=device),
    )


def apply_penalties(
    x: torch.Tensor,
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """vLLM's penalties. x: [R, V] float32; repetition, presence, frequency: [R].

    Repetition looks at prompt and output: a seen token's logit is divided by the penalty
    when positive and multiplied when not, so a penalty > 1 always makes it less likely.
    Presence and frequency look at the output only (OpenAI's definition), subtracting
    presence once per seen token and frequency once per occurrence.
    """
    R, V = x.shape
    r, t = _flat(output_ids, x.device)
    counts = torch.zeros(R, V, dtype=x.dtype, device=x.device)  # [R, V] occurrences in output
    counts.index_put_((r, t), torch.ones_like(t, dtype=x.dtype), accumulate=True)
    pr, pt = _flat(prompt_ids, x.device)
    seen = counts > 0  # [R, V]
    seen[pr, pt] = True
    rep = repetition[:, None]  # [R, 1]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    return x - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(x.dtype)


def apply_logit_bias(x: torch.Tensor, biases: Sequence[Mapping[int, float]]) -> torch.Tensor:
    """Add each row's {token id: bias}. x: [R, V] float32."""
    r, t = _flat([list(b) for b in biases], x.device)
    vals = [v for b in biases for v in b.values()]
    return x.index_put((r, t), torch.tensor(vals, dtype=x.dtype, device=x.device), accumulate=True)


def suppress_tokens(x: torch.Tensor, banned: Sequence[Sequence[int]]) -> torch.Tensor:
    """Set each row's banned ids to -inf (EOS and stop ids before min_tokens). x: [R, V]."""
    r, t = _flat(banned, x.device)
    return x.index_put((r, t), torch.tensor(_NEG_INF, dtype=x.dtype, device=x.device))


def apply_temperature(x: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """(x - row max) / t. x: [R, V] float32; temperature: [R], all > 0.

    Subtracting the max first keeps every value <= 0, so even t = 1e-5 on logits near
    float32's range cannot overflow to inf (and inf - inf to NaN); the softmax is unchanged.
    """
    # The clamp keeps a denormal t (representable in the float64 params, 0 in float32)
    # from dividing 0 by 0 on the max token.
    t = temperature.clamp_min(torch.finfo(x.dtype).tiny)[:, None]  # [R, 1]
    return (x - x.amax(dim=-1, keepdim=True)) / t


def apply_top_k(x: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's k best tokens. x: [R, V]; top_k: [R] ints, 0 = off."""
    k = top_k.clamp(max=x.shape[1])  # [R]
    # Only the k-th best value matters: a partial topk up to the largest k, not a full sort.
    best = x.topk(int(k.max()), dim=-1).values  # [R, kmax], best first
    kth = best.gather(1, (k - 1).clamp(min=0)[:, None])  # [R, 1]
    kth = torch.where(k[:, None] > 0, kth, _NEG_INF)  # off rows: a threshold nothing is below
    return x.masked_fill(x < kth, _NEG_INF)  # ties with the k-th all stay, as in vLLM


def _top_p_cut(
    probs: torch.Tensor, top_p: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """From each row's k most likely tokens: the probability of the last token top-p keeps
    ([R]), and whether those k tokens decide it at all ([R] bool: they reach mass p, or
    the cut falls before the k-th). probs: [R, V]; top_p: [R] float64."""
    best = probs.topk(k, dim=-1).values  # [R, k], best first
    cum = best.cumsum(dim=-1, dtype=torch.float64)  # [R, k]
    before = torch.nn.functional.pad(cum[:, :-1], (1, 0))  # [R, k] mass of the better ones
    n_keep = (before < top_p[:, None]).sum(dim=-1)  # [R] >= 1: the best always stays
    cut = best.gather(1, (n_keep - 1)[:, None]).squeeze(1)  # [R]
    return cut, (n_keep < k) | (cum[:, -1] >= top_p)


def apply_top_p(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's smallest set of best tokens whose mass reaches p. x: [R, V];
    top_p: [R] float64 in (0, 1], or inf for off.

    A full sort of [R, V] costs about five times a topk of 1024 on a CPU, and a trained
    model's nucleus is almost always far smaller than that; so we look at the best
    _TOP_P_CANDIDATES tokens first and fully sort only the rows they do not decide. Which
    path a row takes depends on the row alone, so this never breaks batch invariance.
    The cut is a probability: tokens tied with the last kept one all stay, as in top-k.
    """
    V = x.shape[1]
    probs = x.softmax(dim=-1)  # [R, V]
    on = top_p <= 1  # [R]; off rows carry inf rather than 1, which float cumsums can pass
    cut, decided = _top_p_cut(probs, top_p, min(_TOP_P_CANDIDATES, V))
    redo = (on & ~decided).nonzero().squeeze(1)  # [N] row indexes
    if redo.numel() > 0:
        cut[redo] = _top_p_cut(probs[redo], top_p[redo], V)[0]
    cut = torch.where(on, cut, 0.0)  # [R]
    return x.masked_fill(probs < cut[:, None], _NEG_INF)


def apply_min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than min_p times the row's best. x: [R, V]; min_p: [R]."""
    probs = x.softmax(dim=-1)
    keep = probs >= min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return x.masked_fill(~keep, _NEG_INF)
