"""The batched sampler: distributions, greedy, batch invariance, each stage, logprobs, cost.

Distribution tests draw N tokens from one row of fixed logits (N rows, token_index 0..N-1,
one seed), and compare the counts with probabilities this file computes itself in plain
Python. The seed is fixed, so every run draws the same tokens; the chi-square bound is the
1e-6 tail, so a correct sampler passes by a wide margin whatever hash it uses, while a
missing or wrong stage misses it by orders of magnitude.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from nanoserve.sampling.logits import apply_penalties, apply_temperature, apply_top_p
from nanoserve.sampling.params import SamplingParams
from nanoserve.sampling.sampler import SamplingRow, TokenLogprobs, draw, row_uniform, sample

N = 20_000
SEED = 20240607
# Upper 1e-6 quantiles of chi-square by degrees of freedom (computed with mpmath).
CHI2_1E6 = {1: 23.93, 2: 27.63, 3: 30.66, 4: 33.38, 5: 35.89, 6: 38.26, 7: 40.52}
# Not sorted, so the filters must find the best tokens rather than take a prefix.
LOGITS = [0.7, -0.3, 2.0, -1.5, 1.1, 0.2, 1.6, -0.9]


def _softmax(xs: Sequence[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) if x != -math.inf else 0.0 for x in xs]
    s = sum(e)
    return [v / s for v in e]


def _keep(p: list[float], keep: Callable[[int], bool]) -> list[float]:
    q = [v if keep(i) else 0.0 for i, v in enumerate(p)]
    s = sum(q)
    return [v / s for v in q]


def expected(
    logits: Sequence[float], t: float = 1.0, k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> list[float]:
    """The reference: softmax(l / t), then top-k, top-p, min-p, renormalising after each."""
    p = _softmax([x / t for x in logits])
    if k:
        kth = sorted(p, reverse=True)[k - 1]
        p = _keep(p, lambda i: p[i] >= kth)
    if top_p < 1:
        kept: set[int] = set()
        mass = 0.0
        for i in sorted(range(len(p)), key=lambda i: -p[i]):
            if mass >= top_p:
                break
            kept.add(i)
            mass += p[i]
        p = _keep(p, lambda i: i in kept)
    if min_p:
        top = max(p)
        p = _keep(p, lambda i: p[i] >= min_p * top)
    return p


def draw_many(logits: Sequence[float], params: SamplingParams, n: int = N) -> list[int]:
    x = torch.tensor([list(logits)] * n)  # [n, V]
    rows = [SamplingRow(params, SEED, i, (), ()) for i in range(n)]
    return sample(x, rows, eos_token_ids=()).token_ids


def assert_distribution(tokens: list[int], probs: list[float]) -> None:
    counts = Counter(tokens)
    n = len(tokens)
    never = [i for i, p in enumerate(probs) if p == 0 and counts[i]]
    assert not never, f"filtered tokens drawn: {never}"
    support = [i for i, p in enumerate(probs) if p > 0]
    chi2 = sum((counts[i] - n * probs[i]) ** 2 / (n * probs[i]) for i in support)
    bound = CHI2_1E6[len(support) - 1] if len(support) > 1 else 0.0
    assert chi2 <= bound, f"chi2 {chi2:.1f} > {bound} for {len(support)} tokens; {counts}"


@pytest.mark.parametrize(
    ("kwargs", "support"),
    [
        ({"temperature": 1.0}, 8),
        ({"temperature": 0.6}, 8),
        ({"temperature": 1.7}, 8),
        ({"top_k": 3}, 3),
        ({"top_p": 0.7}, 3),
        ({"top_p": 0.3}, 1),  # the best token alone already has mass 0.37
        ({"min_p": 0.2}, 4),
    ],
)
def test_distribution(kwargs: dict[str, Any], support: int) -> None:
    probs = expected(
        LOGITS,
        kwargs.get("temperature", 1.0),
        kwargs.get("top_k", 0),
        kwargs.get("top_p", 1.0),
        kwargs.get("min_p", 0.0),
    )
    assert sum(p > 0 for p in probs) == support  # the test's logits make each filter bite
    assert_distribution(draw_many(LOGITS, SamplingParams(**kwargs)), probs)


def test_distribution_all_four_filters() -> None:
    # Built so each stage removes something: at t = 0.5 the probabilities are q; top-5 drops
    # the last three, top-p 0.8 keeps .5/.2/.15 of the renormalised five, and min-p 0.35
    # drops .15 (< .35 * .5), leaving two tokens at 5/7 and 2/7.
    q = [0.47, 0.188, 0.141, 0.094, 0.047, 0.03, 0.02, 0.01]
    perm = [5, 2, 7, 0, 3, 6, 1, 4]
    logits = [0.0] * 8
    for src, dst in enumerate(perm):
        logits[dst] = 0.5 * math.log(q[src])
    params = SamplingParams(temperature=0.5, top_k=5, top_p=0.8, min_p=0.35)
    probs = expected(logits, 0.5, 5, 0.8, 0.35)
    assert [round(probs[perm[i]], 6) for i in range(3)] == [round(5 / 7, 6), round(2 / 7, 6), 0]
    assert_distribution(draw_many(logits, params), probs)


def test_distribution_rows_with_different_params_in_one_batch() -> None:
    # Interleaved rows of three parameter sets: each stage must use each row's own values.
    sets = [SamplingParams(temperature=0.6), SamplingParams(top_k=3), SamplingParams(min_p=0.2)]
    x = torch.tensor([LOGITS] * (3 * 6000))
    rows = [SamplingRow(sets[i % 3], SEED, i, (), ()) for i in range(len(x))]
    tokens = sample(x, rows, ()).token_ids
    assert_distribution(tokens[0::3], expected(LOGITS, t=0.6))
    assert_distribution(tokens[1::3], expected(LOGITS, k=3))
    assert_distribution(tokens[2::3], expected(LOGITS, min_p=0.2))


def test_top_p_matches_a_full_sort_on_both_paths() -> None:
    # 3000 tokens: more than the sampler's first look at the best 1024, so a peaked row is
    # decided there and a flat one needs the full sort; both must keep what the plain
    # definition keeps, and a row must come out the same alone or batched.
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 3000, generator=g)
    x[0] *= 8  # peaked
    x[2] *= 0.5  # flat: its nucleus at 0.95 holds most of the vocabulary
    top_p = torch.tensor([0.9, 0.6, 0.95, math.inf], dtype=torch.float64)
    y = apply_top_p(x, top_p)
    for r in range(4):
        probs = sorted(enumerate(x[r].softmax(dim=-1).tolist()), key=lambda t: -t[1])
        kept, mass = set(), 0.0
        for i, pr in probs:
            if mass >= top_p[r].item():
                break
            kept.add(i)
            mass += pr
        assert set(torch.nonzero(y[r] > -math.inf).flatten().tolist()) == kept, f"row {r}"
        assert torch.equal(apply_top_p(x[r : r + 1], top_p[r : r + 1])[0], y[r])
    assert len(kept) == 3000  # row 3 is off
    assert 1024 < sum(bool(v > -math.inf) for v in y[2]) < 3000


def test_draw_never_lands_on_a_filtered_token_at_either_end() -> None:
    inf = math.inf
    x = torch.tensor([[-inf, 0.0, 0.1, 0.2, -inf], [0.0, 0.1, -inf, -inf, -inf]])
    # Rows whose float32 probabilities sum to just under 1, and the largest u there is:
    # u itself, or u * sum rounded, is then past every cdf entry but the -inf tail's.
    assert (x.softmax(dim=-1).double().sum(dim=-1) < 1).all()
    top = torch.full((2,), 1 - 2.0**-53, dtype=torch.float64)
    assert draw(x, top).tolist() == [3, 1]
    assert draw(x, torch.zeros(2, dtype=torch.float64)).tolist() == [1, 0]


def test_row_uniform_is_deterministic_and_in_range() -> None:
    us = [row_uniform(s, i) for s in (0, 1, -5, 2**64 - 1, 10**30) for i in range(2000)]
    assert all(0.0 <= u < 1.0 for u in us)
    assert len(set(us)) == len(us)
    assert row_uniform(7, 3) == row_uniform(7, 3)
    assert abs(sum(us) / len(us) - 0.5) < 0.01


def test_greedy_is_bitwise_argmax() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1000, generator=g) * 4
    x[3, 10] = x[3, 20] = 100.0  # a tie: argmax's first index, whatever the sampler does
    for logits in (x, x.to(torch.bfloat16), x.to(torch.float16)):
        rows = [SamplingRow(SamplingParams(temperature=0), i, i % 7, (), ()) for i in range(64)]
        out = sample(logits, rows, eos_token_ids=(0,))
        assert out.token_ids == torch.argmax(logits, dim=-1).tolist()
        assert out.logprobs == [None] * 64


def test_tiny_temperature_is_argmax_without_overflow() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 4096, generator=g) * 3
    x[torch.arange(32), x.argmax(dim=-1)] += 0.01  # a clear winner in every row
    # Logits near float32's range: dividing by 1e-5 before subtracting the max gives inf,
    # and inf - inf gives NaN. Row 1 also has -inf entries, as a masked model emits.
    x[0] = torch.linspace(-3e34, 3e34, 4096).flip(0)
    x[1, 100:] = -math.inf
    params = SamplingParams(temperature=1e-5, logprobs=2)
    rows = [SamplingRow(params, s, s, (), ()) for s in range(32)]
    out = sample(x, rows, ())
    assert out.token_ids == torch.argmax(x, dim=-1).tolist()
    assert out.token_ids[0] == 0
    lp = out.logprobs[0]
    assert lp is not None
    assert (lp.logprob, lp.rank) == (0.0, 1)
    y = apply_temperature(x, torch.full((32,), 1e-5))
    assert not y.isnan().any()
    assert (y <= 0).all()
    assert (y.amax(dim=-1) == 0).all()


def _neighbours(v: int, g: torch.Generator) -> tuple[torch.Tensor, list[SamplingRow]]:
    """16 rows with logits and params unlike each other's."""
    variants = [
        dict(temperature=0),
        dict(temperature=0, repetition_penalty=1.3, logit_bias={3: 5.0}),
        dict(temperature=0.3, top_k=5),
        dict(temperature=1.5, top_p=0.5),
        dict(min_p=0.3, logprobs=4),
        dict(temperature=0.9, top_k=50, top_p=0.9, min_p=0.05),
        dict(presence_penalty=1.5, frequency_penalty=-1.0),
        dict(min_tokens=5, stop_token_ids=[1, 2]),
        dict(temperature=1e-5),
        dict(top_k=1),
        dict(logit_bias={0: 100.0}),
        dict(top_p=0.01, logprobs=0),
        dict(temperature=2.0, repetition_penalty=0.5),
        dict(frequency_penalty=2.0, top_k=2),
        dict(temperature=0, min_tokens=3, logprobs=20),
        dict(),
    ]
    x = torch.randn(16, v, generator=g) * 3
    rows = [
        SamplingRow(SamplingParams(**kw), 1000 + i, i, [i, 2 * i], [i + 1] * (i % 4))  # type: ignore[arg-type]
        for i, kw in enumerate(variants)
    ]
    return x, rows


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0, "repetition_penalty": 1.2},
        {"temperature": 1.0},
        {"temperature": 0.8, "top_k": 40, "logprobs": 3},
        {"temperature": 1.2, "top_p": 0.9, "min_p": 0.01, "presence_penalty": 0.5},
        {"temperature": 1e-5},
    ],
)
def test_batch_invariance(kwargs: dict[str, Any]) -> None:
    v = 512
    g = torch.Generator().manual_seed(5)
    target_x = torch.randn(v, generator=g) * 2
    nx, nrows = _neighbours(v, g)
    params = SamplingParams(**kwargs)
    alone, among = [], []
    for t in range(12):
        row = SamplingRow(params, 42, t, [1, 2, 3], [4, 4, 5][: t % 4])
        a = sample(target_x[None], [row], eos_token_ids=(7,))
        alone.append((a.token_ids[0], a.logprobs[0]))
        for pos in (0, 7, 16):
            order = list(range(16))
            random.Random(t * 31 + pos).shuffle(order)  # different neighbours each time
            xs = [nx[i] for i in order]
            rs = [nrows[i] for i in order]
            xs.insert(pos, target_x)
            rs.insert(pos, row)
            b = sample(torch.stack(xs), rs, eos_token_ids=(7,))
            among.append((b.token_ids[pos], b.logprobs[pos]))
        assert among[-3:] == [alone[-1]] * 3, f"token_index {t}"
    if params.temperature >= 1:
        assert len({tok for tok, _ in alone}) > 1  # the target really draws


def _one(
    x: list[float],
    params: SamplingParams,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    index: int = 0,
    eos: Sequence[int] = (),
) -> int:
    row = SamplingRow(params, 0, index, prompt, output)
    return sample(torch.tensor([x]), [row], eos).token_ids[0]


def test_repetition_penalty() -> None:
    x = [2.0, 1.5, 0.0]
    assert _one(x, SamplingParams(temperature=0), prompt=[0]) == 0
    assert _one(x, SamplingParams(temperature=0, repetition_penalty=1.5), prompt=[0]) == 1
    assert _one(x, SamplingParams(temperature=0, repetition_penalty=1.5), output=[0]) == 1
    # Positive logits are divided, negative ones multiplied: both move away from likely.
    one = torch.ones(1)
    y = apply_penalties(
        torch.tensor([[2.0, -1.0, 1.0, -2.0]]), [[0]], [[1]], one * 2, one * 0, one * 0
    )
    assert y.tolist() == [[1.0, -2.0, 1.0, -2.0]]


def test_penalty_values() -> None:
    # Token 0 is in the prompt only, 1 in both (once in the output), 2 twice in the output.
    one = torch.ones(1)
    x = torch.ones(1, 4)
    y = apply_penalties(x, [[0, 1]], [[1, 2, 2]], one, one * 0.5, one * 0.25)
    assert y.tolist() == [[1.0, 0.25, 0.0, 1.0]]
    y = apply_penalties(x, [[0, 1]], [[1, 2, 2]], one * 2, one * 0.5, one * 0.25)
    assert y.tolist() == [[0.5, -0.25, -0.5, 1.0]]


def test_presence_penalty_counts_output_only() -> None:
    x = [1.0, 0.5, 0.0]
    p = SamplingParams(temperature=0, presence_penalty=0.8)
    assert _one(x, p, prompt=[0]) == 0  # the prompt does not count
    assert _one(x, p, output=[0]) == 1  # 1.0 - 0.8 < 0.5
    assert _one(x, p, output=[1, 1, 1, 1]) == 0
    # Once, however many times: 1.0 - 0.8 beats 0.5 - 0.8.
    assert _one(x, p, output=[0, 0, 0, 1]) == 0


def test_frequency_penalty_scales_with_count() -> None:
    x = [1.0, 0.5, 0.0]
    p = SamplingParams(temperature=0, frequency_penalty=0.2)
    assert _one(x, p, output=[0]) == 0  # 0.8 > 0.5
    assert _one(x, p, output=[0, 0, 0]) == 1  # 0.4 < 0.5
    assert _one(x, p, prompt=[0, 0, 0], output=[0]) == 0  # the prompt does not count
    assert (
        _one(x, SamplingParams(temperature=0, frequency_penalty=-2), output=[2]) == 2
    )  # negative: encourage repetition


def test_logit_bias_forces_and_bans() -> None:
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(256, generator=g) * 2).tolist()
    forced = draw_many(x, SamplingParams(logit_bias={17: 100}), n=500)
    assert set(forced) == {17}
    x[3] = 12.0  # dominant, until banned
    assert Counter(draw_many(x, SamplingParams(), n=500))[3] > 450
    assert 3 not in draw_many(x, SamplingParams(logit_bias={3: -100}), n=500)
    # The bias also applies to greedy rows.
    assert _one(x, SamplingParams(temperature=0, logit_bias={5: 100})) == 5


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_suppresses_eos_and_stop_ids(temperature: float) -> None:
    x = [0.0] * 16
    x[5], x[9] = 20.0, 19.0  # 5 is EOS, 9 a stop token id
    p = SamplingParams(temperature=temperature, min_tokens=3, stop_token_ids=(9,))
    drawn = [_one(x, p, output=[1] * i, index=i, eos=[5]) for i in range(5)]
    assert all(tok not in (5, 9) for tok in drawn[:3])
    assert all(tok in (5, 9) for tok in drawn[3:])  # from then on, free to stop
    # Without min_tokens, the first token is already EOS.
    assert _one(x, SamplingParams(temperature=temperature), eos=[5]) == 5


def test_min_tokens_with_ignore_eos_leaves_eos_alone() -> None:
    # EOS does not end such a request, so there is nothing to hold back; stop ids still do.
    x = [0.0] * 16
    x[5], x[9] = 20.0, 21.0
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(9,), ignore_eos=True)
    assert _one(x, p, eos=[5]) == 5


def test_logprobs_are_raw() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 50, generator=g) * 2
    lowest = int(x[3].argmin())
    params = [
        SamplingParams(temperature=0.3, repetition_penalty=2.0, presence_penalty=2, logprobs=5),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0, logit_bias={lowest: 100}, logprobs=20),
    ]
    rows = [SamplingRow(p, 9, 0, list(range(40)), list(range(10))) for p in params]
    out = sample(x, rows, ())
    ref = torch.log_softmax(x, dim=-1)
    assert out.logprobs[2] is None
    for i in (0, 1, 3):
        lp = out.logprobs[i]
        assert isinstance(lp, TokenLogprobs)
        tok = out.token_ids[i]
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(ref[i, tok].item(), abs=1e-6)
        assert lp.rank == 1 + int((ref[i] > ref[i, tok]).sum())
        n = params[i].logprobs or 0
        vals, ids = ref[i].topk(n)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(vals.tolist(), abs=1e-6)
    assert out.logprobs[1] is not None
    assert out.logprobs[1].top == ()
    lp3 = out.logprobs[3]
    assert out.token_ids[3] == lowest
    assert lp3 is not None
    assert lp3.rank == 50


class _CountOps(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _ops(x: torch.Tensor, rows: list[SamplingRow]) -> int:
    with _CountOps() as c:
        sample(x, rows, eos_token_ids=(0,))
    return c.calls


def test_all_greedy_batch_is_one_argmax() -> None:
    # The cost of 64 x 49152 all-greedy is an argmax: no copy, no per-row work.
    x = torch.randn(64, 49152)
    rows = [SamplingRow(SamplingParams(temperature=0), i, 0, [1, 2], [3]) for i in range(64)]
    assert _ops(x, rows) <= 4


def test_tensor_work_does_not_grow_with_rows() -> None:
    # A per-row loop over tensors would make the op count grow with the batch.
    def rows(r: int) -> list[SamplingRow]:
        kinds = [
            dict(temperature=0, repetition_penalty=1.1, logit_bias={1: 2.0}),
            dict(
                temperature=0.7,
                top_k=20,
                top_p=0.9,
                min_p=0.05,
                presence_penalty=0.5,
                frequency_penalty=0.5,
                min_tokens=2,
                logprobs=3,
            ),
        ]
        return [
            SamplingRow(SamplingParams(**kinds[i % 2]), i, 1, [5] * i, [6, 7])  # type: ignore[arg-type]
            for i in range(r)
        ]

    x = torch.randn(64, 2048)
    assert _ops(x[:8], rows(8)) == _ops(x, rows(64))
