"""The batched sampler: logits [R, V] in, one token per row out, as small pure tensor stages.

The stages run in a fixed order, each vectorised over rows whose parameters differ (every
parameter becomes a per-row tensor [R]): penalties, logit bias, min_tokens suppression, a
constrained row's grammar mask (nanoserve/sampling/grammar.py: the tokens it does not allow go to
-inf), then greedy rows take their argmax here, and the rest go through temperature, top-k, top-p,
min-p and the draw. A stage no row uses is skipped, so an all-greedy batch with no penalties
is one argmax. A row with the neutral value of a stage (repetition 1, top_p 1, min_p 0, ...)
comes out of it bit-for-bit unchanged, so skipping or running a stage never changes a row.

Randomness. A row's draw must depend only on (seed, token_index) and its own logits: not on
its neighbours, the step, or preemption (docs/ARCHITECTURE.md: "a seeded request's tokens do
not depend on what else shares its batch"). Each row therefore draws exactly one uniform u
in [0, 1), the top 53 bits of a splitmix64 hash of (seed, token_index), and takes the token
where u falls in the row's cumulative distribution (inverse CDF: cumsum + searchsorted). We
chose a hash over a torch.Generator seeded per row: it needs no generator object per row per
step, it is the same number on every device and every torch version (a CUDA and a CPU Philox
do not agree), and one number per row is all inverse CDF needs, where an exponential race
would need V of them. Every stage reduces along the vocabulary only, and which path a row
takes (greedy or not, top-p's first look or full sort) depends on the row alone, so a row's
numbers are the same whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nanoserve.sampling.grammar import apply_bitmasks
from nanoserve.sampling.logits import (
    apply_logit_bias,
    apply_min_p,
    apply_penalties,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    suppress_tokens,
)
from nanoserve.sampling.params import SamplingParams
from nanoserve.sampling.seeds import MASK64, mix64


@dataclass(slots=True)
class SamplingRow:
    params: SamplingParams
    seed: int  # effective seed: the request's (child's) own, or one the engine derived
    token_index: int  # index in this request's output of the token being drawn (0 = first)
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    # A constrained row's allowed tokens (nanoserve/sampling/grammar.py's bitmask); None: free.
    mask: bytes | None = None


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
    # min_tokens bans the end on free rows only: a constraint decides where it may end, and
    # a ban on top of a grammar that allows only EOS would leave a row with nothing.
    banned = [
        [*p.stop_token_ids, *(() if p.ignore_eos else eos)]
        if r.token_index < p.min_tokens and r.mask is None else []
        for r, p in zip(rows, ps, strict=True)
    ]
    masked = [i for i, r in enumerate(rows) if r.mask is not None]
    if not any(pen) and not any(p.logit_bias for p in ps) and not any(banned) and not masked:
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
    if masked:
        x = apply_bitmasks(x, masked, [m for r in rows if (m := r.mask) is not None])
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
