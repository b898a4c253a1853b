"""The batched sampler: logits [R, V] in, one token per row out, as small pure tensor stages.

The stages run in a fixed order, each vectorised over rows whose parameters differ (every
parameter becomes a per-row tensor [R]): penalties, logit bias, min_tokens suppression, then
greedy rows take their argmax here, and the rest go through temperature, top-k, top-p,
min-p and the draw. A stage no row uses is skipped, so an all-greedy batch with no penalties
is one argmax. A row with the neutral value of a stage (repetition 1, top_p 1, min_p 0, ...)
comes out of it bit-for-bit unchanged, so skipping or running a stage never changes a row.

Randomness. A row's draw must depend only on (seed, token_index) and its own logits: not on
its neighbours, the step, or preemption (DESIGN.md: "a seeded request's tokens do not depend
on what else shares its batch"). Each row therefore draws exactly one uniform u in [0, 1),
the top 53 bits of a splitmix64 hash of (seed, token_index), and takes the token where u
falls in the row's cumulative distribution (inverse CDF: cumsum + searchsorted). We chose a
hash over a torch.Generator seeded per row: it needs no generator object per row per step,
it is the same number on every device and every torch version (a CUDA and a CPU Philox do
not agree), and one number per row is all inverse CDF needs, where an exponential race
would need V of them. Every stage reduces along the vocabulary only, and which path a row
takes (greedy or not, top-p's first look or full sort) depends on the row alone, so a row's
numbers are the same whatever else is in the batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from nanoserve.sampling import SamplingParams
from nanoserve.seeds import MASK64, mix64

_NEG_INF = float("-inf")
_TOP_P_CANDIDATES = 1024  # see apply_top_p


@dataclass(slots=True)
class SamplingRow:
    params: SamplingParams
    seed: int  # effective seed: the request's (child's) own, or one the engine derived
    token_index: int  # index in this request's output of the token being drawn (0 = first)
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float  # of the raw logits, before penalties, temperature and filtering
    rank: int  # 1 + how many tokens have a strictly higher raw logprob
    top: tuple[tuple[int, float], ...]  # the `logprobs` best (token_id, logprob), best first


@dataclass(frozen=True, slots=True)
class SampleOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def row_uniform(seed: int, token_index: int) -> float:
    """The one uniform in [0, 1) that the draw of (seed, token_index) uses."""
    # mix(seed) ^ index, mixed again: for one seed, distinct indexes give distinct hashes.
    h = mix64(mix64(seed & MASK64) ^ (token_index & MASK64))
    return (h >> 11) * 2.0**-53  # 53 bits: exactly representable, and always < 1


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


def draw(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: the token where u falls in softmax(x). x: [R, V]; u: [R] float64 in [0, 1).

    A filtered token (-inf, probability exactly 0) adds nothing to the cumulative sum, so
    its interval is empty and it can never be drawn.
    """
    probs = x.softmax(dim=-1)  # [R, V]
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # [R, V]; float64: no drift over 100k+ ids
    total = cdf[:, -1]  # [R]; about 1, so u is scaled by it rather than trusted to fit
    # u <= 1 - 2**-53, so u * total stays below total in IEEE doubles (the shortfall,
    # total * 2**-53, is never under half an ulp of total): the first cdf entry above the
    # target always exists, and sits at a token with mass > 0.
    target = u * total
    idx = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)  # first cdf > target
    return idx.clamp(max=x.shape[1] - 1)  # only an all -inf (NaN) row can reach V


def _stage_tensor(values: list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def _process(logits: torch.Tensor, rows: Sequence[SamplingRow], eos: Sequence[int]) -> torch.Tensor:
    """Penalties, logit bias and min_tokens: the stages that greedy rows also see."""
    ps = [r.params for r in rows]
    dev = logits.device
    pen = [
        p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0 for p in ps
    ]
    banned = [
        [*p.stop_token_ids, *(() if p.ignore_eos else eos)] if r.token_index < p.min_tokens else []
        for r, p in zip(rows, ps, strict=True)
    ]
    if not any(pen) and not any(p.logit_bias for p in ps) and not any(banned):
        return logits
    x = logits.to(torch.float32, copy=True)  # [R, V]; never write to the model's tensor
    if any(pen):
        f32 = torch.float32
        x = apply_penalties(
            x,
            [r.prompt_ids if r.params.repetition_penalty != 1 else () for r in rows],
            [r.output_ids if u else () for r, u in zip(rows, pen, strict=True)],
            _stage_tensor([p.repetition_penalty for p in ps], f32, dev),
            _stage_tensor([p.presence_penalty for p in ps], f32, dev),
            _stage_tensor([p.frequency_penalty for p in ps], f32, dev),
        )
    if any(p.logit_bias for p in ps):
        x = apply_logit_bias(x, [p.logit_bias for p in ps])
    if any(banned):
        x = suppress_tokens(x, banned)
    return x


def _filter_and_draw(x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, draw, for rows with temperature > 0. x: [S, V]."""
    ps = [r.params for r in rows]
    dev, V = x.device, x.shape[1]
    x = apply_temperature(x.float(), _stage_tensor([p.temperature for p in ps], torch.float32, dev))
    if any(0 < p.top_k < V for p in ps):
        ks = [p.top_k if p.top_k < V else 0 for p in ps]
        x = apply_top_k(x, torch.tensor(ks, dtype=torch.long, device=dev))
    if any(p.top_p < 1 for p in ps):
        top_p = [p.top_p if p.top_p < 1 else float("inf") for p in ps]
        x = apply_top_p(x, _stage_tensor(top_p, torch.float64, dev))
    if any(p.min_p > 0 for p in ps):
        x = apply_min_p(x, _stage_tensor([p.min_p for p in ps], torch.float32, dev))
    # The one per-row Python loop: one hashed uniform per row.
    u = _stage_tensor([row_uniform(r.seed, r.token_index) for r in rows], torch.float64, dev)
    return draw(x, u)


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, ks: Sequence[int]
) -> list[TokenLogprobs]:
    """Raw logprobs of `tokens` under `logits`, with each row's ks[i] best alternatives.
    logits: [L, V] any float dtype; tokens: [L]. Used for sampled tokens and prompt tokens."""
    if logits.shape[0] == 0:
        return []
    lp = logits.float().log_softmax(dim=-1)  # [L, V]
    chosen = tokens[:, None]  # [L, 1]
    chosen_lp = lp.gather(1, chosen)  # [L, 1]
    rank = (lp > chosen_lp).sum(dim=-1) + 1  # [L]; ties share the better rank
    k = min(max(ks), lp.shape[1])
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], chosen[:, :0])  # [L, k]
    tv, ti = top_v.tolist(), top_i.tolist()  # one host copy for all rows
    return [
        TokenLogprobs(c, c_lp, rk, tuple(zip(ti[j][:n], tv[j][:n], strict=True)))
        for j, (n, c, c_lp, rk) in enumerate(
            zip(ks, chosen[:, 0].tolist(), chosen_lp[:, 0].tolist(), rank.tolist(), strict=True)
        )
    ]


def _logprobs(
    logits: torch.Tensor, rows: Sequence[SamplingRow], tokens: torch.Tensor
) -> list[TokenLogprobs | None]:
    """Raw logprobs (before penalties, temperature, filtering, as vLLM reports them)."""
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(rows)
    if not want:
        return out
    idx = torch.tensor(want, dtype=torch.long, device=logits.device)
    got = token_logprobs(
        logits.index_select(0, idx), tokens.index_select(0, idx),
        [rows[i].params.logprobs or 0 for i in want],
    )
    for i, lp in zip(want, got, strict=True):
        out[i] = lp
    return out


def sample(
    logits: torch.Tensor, rows: Sequence[SamplingRow], eos_token_ids: Sequence[int]
) -> SampleOutput:
    """One token per row. logits: [R, V], any float dtype, on any device; not modified."""
    R = logits.shape[0]
    if len(rows) != R:
        raise ValueError(f"{R} rows of logits but {len(rows)} sampling rows")
    if R == 0:
        return SampleOutput([], [])
    x = _process(logits, rows, eos_token_ids)  # [R, V]
    greedy = [r.params.temperature == 0 for r in rows]
    if all(greedy):
        tokens = x.argmax(dim=-1)  # [R]: the fast path, bitwise torch.argmax
    elif not any(greedy):
        tokens = _filter_and_draw(x, rows)
    else:  # a mixed batch: argmax the greedy rows, draw the others
        dev = logits.device
        tokens = torch.empty(R, dtype=torch.long, device=dev)
        g = torch.tensor([i for i in range(R) if greedy[i]], dtype=torch.long, device=dev)
        s = [i for i in range(R) if not greedy[i]]
        si = torch.tensor(s, dtype=torch.long, device=dev)
        tokens[g] = x.index_select(0, g).argmax(dim=-1)
        tokens[si] = _filter_and_draw(x.index_select(0, si), [rows[i] for i in s])
    return SampleOutput(tokens.tolist(), _logprobs(logits, rows, tokens))
