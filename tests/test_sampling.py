"""SamplingParams: every invalid value of every field is a ParamError naming that field."""

from __future__ import annotations

import math
from typing import Any

import pytest

from nanoserve.engine.admission import check_token_ids, fit_context
from nanoserve.sampling.params import ParamError, SamplingParams

NAN, INF = math.nan, math.inf

# (field, bad value). One row per way a client can get each field wrong: out of range, not
# finite, a bool where a number belongs, a string where a number belongs, null where null
# means nothing.
INVALID: list[tuple[str, Any]] = [
    *[("n", v) for v in (0, -1, 129, 1.0, True, "2", None)],
    *[("temperature", v) for v in (-0.1, -1e-9, NAN, INF, -INF, True, "1", None)],
    *[("top_p", v) for v in (0, 0.0, -0.5, 1.0001, 2, NAN, INF, True, "0.5", None)],
    *[("top_k", v) for v in (-2, -100, 1.5, 5.0, True, "5", None)],
    *[("min_p", v) for v in (-0.01, 1.01, NAN, INF, True, "0", None)],
    *[("seed", v) for v in (1.5, 7.0, True, False, "7", [7], 2**63, -(2**63) - 1, 10**30)],
    *[("max_tokens", v) for v in (0, -1, 1.5, 16.0, True, "16")],
    *[("min_tokens", v) for v in (-1, 1.5, True, "1", None)],
    *[("ignore_eos", v) for v in (1, 0, "true", None)],
    *[("include_stop_str_in_output", v) for v in (1, "no", None)],
    *[("skip_special_tokens", v) for v in (0, "yes", None)],
    *[("detokenize", v) for v in (1, "false", None)],
    *[
        ("stop_token_ids", v)
        for v in ("5", 5, [1, -1], [1, True], [1.0], [None], None, {1: 2}, b"\x01")
    ],
    *[("stop", v) for v in (5, ["a", 1], ["a"] * 5, "", ["a", ""], [None], {"a": 1}, b"x")],
    *[("presence_penalty", v) for v in (2.01, -2.01, NAN, INF, True, "1", None)],
    *[("frequency_penalty", v) for v in (2.5, -3, NAN, -INF, False, "0", None)],
    *[("repetition_penalty", v) for v in (0, 0.0, -1, NAN, INF, True, "1", None)],
    *[
        ("logit_bias", v)
        for v in (
            [1, 2],
            "x",
            5,
            {"a": 1},
            {"-1": 1},
            {-1: 1},
            {"1.5": 1},
            {" 5": 1},
            {"\u0661": 1},
            {True: 1},
            {1.0: 1},
            {None: 1},
            {1: 100.5},
            {1: -101},
            {1: NAN},
            {1: INF},
            {1: "1"},
            {1: True},
            {1: None},
            {"5": 1, 5: 2},
        )
    ],
    *[("logprobs", v) for v in (-1, 21, 1.0, True, "5")],
    *[("prompt_logprobs", v) for v in (-1, 21, 1.0, True, "5")],
    *[("guided", v) for v in ('{"type": "object"}', {"type": "object"}, 1)],
    *[("speculate", v) for v in (1, 0, "true", None)],
]


@pytest.mark.parametrize(("field", "value"), INVALID)
def test_invalid_value_names_its_field(field: str, value: Any) -> None:
    with pytest.raises(ParamError) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field
    assert field in str(info.value)
    if not isinstance(value, list | dict | bytes):
        assert repr(value) in str(info.value) or "at most" in str(info.value)


def test_every_field_has_an_invalid_case() -> None:
    fields = {f for f, _ in INVALID}
    assert fields == set(SamplingParams.__dataclass_fields__)


@pytest.mark.parametrize(
    ("kwargs", "field", "text"),
    [
        ({"n": 0}, "n", "in [1, 128], got 0"),
        ({"temperature": -1}, "temperature", ">= 0, got -1"),
        ({"top_p": 0}, "top_p", "in (0, 1], got 0"),
        ({"top_k": -5}, "top_k", "0 or -1 (off), or >= 1, got -5"),
        ({"min_p": 2}, "min_p", "in [0, 1], got 2"),
        ({"presence_penalty": 3}, "presence_penalty", "in [-2.0, 2.0], got 3"),
        ({"repetition_penalty": 0}, "repetition_penalty", "> 0, got 0"),
        ({"logit_bias": {"7": 200}}, "logit_bias", "in [-100.0, 100.0], got 200 (bias of token 7)"),
        ({"seed": 2**63}, "seed", "in [-2**63, 2**63 - 1] (or null), got 9223372036854775808"),
        ({"logprobs": 21}, "logprobs", "in [0, 20] (or null), got 21"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4 strings, got 5"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens", "in [0, max_tokens=4], got 5"),
    ],
)
def test_message_gives_value_and_allowed_range(
    kwargs: dict[str, Any], field: str, text: str
) -> None:
    with pytest.raises(ParamError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field
    assert text in str(info.value)


def test_param_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def test_defaults() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.seed, p.max_tokens, p.min_tokens, p.logprobs) == (None, None, 0, None)
    assert (p.ignore_eos, p.include_stop_str_in_output, p.skip_special_tokens) == (
        False,
        False,
        True,
    )
    assert (p.stop_token_ids, p.stop, p.logit_bias) == ((), (), {})
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)


def make(**kwargs: Any) -> SamplingParams:
    """Build from untyped values, as the HTTP layer does from JSON (lists, string keys)."""
    return SamplingParams(**kwargs)


def test_normalisation() -> None:
    p = make(
        temperature=0,
        top_p=1,
        top_k=-1,
        stop="END",
        stop_token_ids=[7, 8],
        logit_bias={"12": 5, 3: -1},
        presence_penalty=1,
    )
    assert p.top_k == 0
    assert p.stop == ("END",)
    assert p.stop_token_ids == (7, 8)
    assert p.logit_bias == {12: 5.0, 3: -1.0}
    assert all(isinstance(k, int) for k in p.logit_bias)
    assert all(type(v) is float for v in (p.temperature, p.top_p, p.presence_penalty))
    assert make(stop=["a", "b"]).stop == ("a", "b")
    assert make(stop=None, logit_bias=None).stop == ()


def test_edge_values_are_valid() -> None:
    SamplingParams(n=128, temperature=0.0, top_p=1e-9, top_k=1, min_p=1.0, seed=-(2**63))
    SamplingParams(seed=2**63 - 1, top_k=2**70)  # a top_k past the vocabulary keeps them all
    SamplingParams(max_tokens=1, min_tokens=1, logprobs=0, repetition_penalty=1e-6)
    SamplingParams(logprobs=20, presence_penalty=-2, frequency_penalty=2)
    make(logit_bias={"0": -100, 1: 100}, stop=["a", "b", "c", "d"], temperature=1e-5)
    SamplingParams(min_tokens=1000)  # no max_tokens: the context bounds it later


def test_revalidates_after_replace() -> None:
    import dataclasses

    with pytest.raises(ParamError) as info:
        dataclasses.replace(SamplingParams(), top_p=0)
    assert info.value.field == "top_p"


def test_admission_fits_the_context_and_vocabulary() -> None:
    p = SamplingParams(max_tokens=10, logit_bias={99: 1}, stop_token_ids=(98,))
    check_token_ids(p, 100)
    assert fit_context(p.max_tokens, 10, 20) == 10  # exactly fits
    with pytest.raises(ParamError) as info:
        fit_context(p.max_tokens, 13, 20)
    assert info.value.field == "max_tokens"
    assert "by 3" in str(info.value)
    assert "(13 tokens)" in str(info.value)
    assert "max_model_len 20" in str(info.value)
    with pytest.raises(ParamError) as info:
        check_token_ids(p, 99)
    assert info.value.field == "logit_bias"
    assert "99" in str(info.value)
    with pytest.raises(ParamError) as info:
        check_token_ids(SamplingParams(stop_token_ids=(98,)), 98)
    assert info.value.field == "stop_token_ids"
    # No max_tokens: the engine gives the request whatever the context leaves.
    assert fit_context(SamplingParams().max_tokens, 4, 5) == 1


def test_child() -> None:
    p = make(n=3, seed=10, temperature=0.5, stop="x")
    kids = [p.child(i) for i in range(3)]
    assert [k.seed for k in kids] == [10, 11, 12]
    assert all(k.n == 1 and k.temperature == 0.5 and k.stop == ("x",) for k in kids)
    assert (p.n, p.seed) == (3, 10)  # the parent is untouched
    assert SamplingParams(n=2).child(1).seed is None
    with pytest.raises(IndexError):
        p.child(3)
    with pytest.raises(IndexError):
        p.child(-1)


def test_child_seeds_wrap_within_64_bits() -> None:
    """seed 2**63 - 1 with n = 2: the second child's seed + 1 wraps to -2**63 (a valid seed,
    the same draws: the sampler hashes seeds modulo 2**64), never a ParamError mid-engine."""
    p = SamplingParams(n=3, seed=2**63 - 1)
    assert [p.child(i).seed for i in range(3)] == [2**63 - 1, -(2**63), -(2**63) + 1]


@pytest.mark.parametrize(
    ("kwargs", "field", "text"),
    [
        # Every bad item of a field is named, a few of them and then how many more.
        ({"logit_bias": {"x": 1, "-5": 2, "7": 3, "y": 4}}, "logit_bias",
         "keys must be token ids >= 0 (int or decimal string), got 'x', '-5', 'y'"),
        ({"logit_bias": {"5": 500, "6": 1, "7": NAN}}, "logit_bias",
         "got 500 (bias of token 5), nan (bias of token 7)"),
        ({"logit_bias": {str(i): 101 for i in range(8)}}, "logit_bias",
         "101 (bias of token 4) and 3 more"),
        ({"logit_bias": {"5": 1, 5: 2, "6": 1, 6: 2}}, "logit_bias", "token ids 5, 6 twice"),
        ({"stop_token_ids": [1, -1, "x", 2, 1.5]}, "stop_token_ids",
         "got [1] -1, [2] 'x', [4] 1.5"),
        ({"stop_token_ids": list(range(-9, 0))}, "stop_token_ids",
         "got [0] -9, [1] -8, [2] -7, [3] -6, [4] -5 and 4 more"),
        ({"stop": ["a", "", "b", ""]}, "stop", "([1], [3] empty)"),
    ],
)
def test_message_names_every_bad_item(kwargs: dict[str, Any], field: str, text: str) -> None:
    with pytest.raises(ParamError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field
    assert text in str(info.value), str(info.value)


def test_admission_names_every_id_outside_the_vocabulary() -> None:
    p = SamplingParams(logit_bias={100: 1, 5: 1, 101: 1}, stop_token_ids=(7, 100, 102))
    with pytest.raises(ParamError) as info:
        check_token_ids(p, 100)
    assert (info.value.field, info.value.message) == (
        "logit_bias", "logit_bias: token ids 100, 101 are outside the vocabulary [0, 100)")
    with pytest.raises(ParamError) as info:
        check_token_ids(SamplingParams(stop_token_ids=tuple(range(90, 110))), 100)
    assert info.value.message == ("stop_token_ids: token ids 100, 101, 102, 103, 104 and 5 "
                                  "more are outside the vocabulary [0, 100)")
