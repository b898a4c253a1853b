"""SamplingParams: what a request asks of the sampler, validated in one place.

Semantics follow vLLM and the OpenAI API, so a body that either accepts means the same
thing here. Every check of what can be judged from the params alone lives in
`SamplingParams.__post_init__`; what needs the model and the prompt (token ids against the
vocabulary, prompt plus max_tokens against the context and the KV pool, and max_tokens
resolved where it is None) is engine/admission.py's. A failure raises `ParamError`, whose
`.field` names the offending field and whose message names the field, the value given and
the range allowed, so the HTTP layer can turn it into a 400 without knowing anything about
sampling.

The dataclass is not frozen (normalisation in `__post_init__` assigns fields), but treat it
as immutable once built: the engine shares one instance among the n children of a request.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nanoserve.sampling.grammar import GuidedSpec

MAX_N = 128
MAX_LOGPROBS = 20  # the OpenAI API's cap on top alternatives per token
MAX_STOP_STRINGS = 4  # the OpenAI API's cap
MAX_ABS_PENALTY = 2.0
MAX_ABS_LOGIT_BIAS = 100.0
# A seed is a signed 64-bit integer, as in vLLM (torch.long's range) and what it answers a
# 400 outside of: the sampler hashes it modulo 2**64, so a wider one would silently give the
# draws of another seed.
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1
NAMED = 5  # a message lists this many of a field's bad items, then "and N more"
_DECIMAL = re.compile(r"[0-9]+")  # ASCII only: str.isdecimal() would accept "١٢"


class ParamError(ValueError):
    """An invalid request parameter. `.field` is its name; the message says why."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


def few(items: Sequence[object], limit: int = NAMED) -> str:
    """The first `limit` of `items` as text, then how many more: a message names each bad
    item of a field (every bad logit_bias key, not only the first) without growing with it."""
    shown = ", ".join(str(i) for i in items[:limit])
    return shown if len(items) <= limit else f"{shown} and {len(items) - limit} more"


def _wrap64(x: int) -> int:
    """`x` as a signed 64-bit integer (two's complement), its value modulo 2**64."""
    return (x - MIN_SEED) % 2**64 + MIN_SEED


def _int(name: str, value: object, lo: int | None, hi: int | None, allowed: str) -> int:
    # bool is a subclass of int, but `"n": true` is a client bug, not a request for one.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParamError(name, f"{name} must be an integer {allowed}, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ParamError(name, f"{name} must be {allowed}, got {value!r}")
    return value


def _float(name: str, value: object, ok: bool | None, allowed: str) -> float:
    """Check a number; `ok` is None to only type-check, else whether the range check passed."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ParamError(name, f"{name} must be a number {allowed}, got {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an integer past the largest double: outside every range here
        number = math.inf
    if not math.isfinite(number) or ok is False:
        raise ParamError(name, f"{name} must be {allowed}, got {value!r:.80}")
    return number


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ParamError(name, f"{name} must be true or false, got {value!r}")
    return value


def _in(value: object, lo: float, hi: float) -> bool | None:
    # Range checks run only on real numbers; _float reports anything else as a type error.
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return lo <= value <= hi


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy: exact argmax, no draw
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, normalised to 0) means off
    min_p: float = 0.0
    seed: int | None = None
    # None: whatever the context leaves. Admission resolves it once (engine/admission.py):
    # after that, Request.max_tokens is the value every reader uses.
    max_tokens: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    # vLLM's prompt_logprobs: the logprob of every prompt token after the first given the
    # ones before it, with this many top alternatives. It costs logits at every prompt
    # position (normally only the last), and such a request skips the prefix cache.
    prompt_logprobs: int | None = None
    # vLLM's detokenize: False leaves the text empty and skips the incremental detokenizer,
    # which is a fifth of a simulated token's cost in a capacity sweep that never reads text.
    detokenize: bool = True
    # Structured outputs (nanoserve/sampling/grammar.py): the constraint every token must keep to.
    guided: GuidedSpec | None = None
    # False: no speculative proposals for this request where the engine has them
    # (engine/speculative.py); its tokens are the same either way, only their pace differs.
    speculate: bool = True

    def __post_init__(self) -> None:
        self.n = _int("n", self.n, 1, MAX_N, f"in [1, {MAX_N}]")
        t = self.temperature
        self.temperature = _float("temperature", t, _in(t, 0.0, math.inf), ">= 0")
        p = self.top_p
        self.top_p = _float("top_p", p, _in(p, 0.0, 1.0) and p > 0, "in (0, 1]")
        k = _int("top_k", self.top_k, -1, None, "0 or -1 (off), or >= 1")
        self.top_k = 0 if k == -1 else k
        self.min_p = _float("min_p", self.min_p, _in(self.min_p, 0.0, 1.0), "in [0, 1]")
        if self.seed is not None:
            self.seed = _int("seed", self.seed, MIN_SEED, MAX_SEED,
                             "in [-2**63, 2**63 - 1] (or null)")
        if self.max_tokens is not None:
            self.max_tokens = _int("max_tokens", self.max_tokens, 1, None, ">= 1 (or null)")
        hi = self.max_tokens
        self.min_tokens = _int(
            "min_tokens",
            self.min_tokens,
            0,
            hi,
            ">= 0" if hi is None else f"in [0, max_tokens={hi}]",
        )
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "detokenize", "speculate"):
            setattr(self, name, _bool(name, getattr(self, name)))
        self.stop_token_ids = _token_ids(self.stop_token_ids)
        self.stop = _stop_strings(self.stop)
        if self.stop and not self.detokenize:
            raise ParamError("stop", "stop strings are matched on the text: they need "
                             "detokenize=True")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            m = MAX_ABS_PENALTY
            setattr(self, name, _float(name, v, _in(v, -m, m), f"in [{-m}, {m}]"))
        rp = self.repetition_penalty
        self.repetition_penalty = _float(
            "repetition_penalty", rp, _in(rp, 0.0, math.inf) and rp > 0, "> 0"
        )
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.logprobs is not None:
            self.logprobs = _int(
                "logprobs", self.logprobs, 0, MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}] (or null)"
            )
        if self.guided is not None and not isinstance(self.guided, GuidedSpec):
            raise ParamError("guided", "guided must be a GuidedSpec "
                             f"(nanoserve.sampling.grammar), got {self.guided!r:.80}")
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _int(
                "prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS,
                f"in [0, {MAX_LOGPROBS}] (or null)",
            )

    def child(self, i: int) -> SamplingParams:
        """The params of the i-th of this request's n completions: n=1, and seed+i when seeded,
        so the children differ from each other but each is reproducible on its own."""
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.n:
            raise IndexError(f"child index {i!r} outside [0, {self.n})")
        # Wrapped into 64 bits (seed 2**63 - 1 with n=2): the draws hash the seed modulo
        # 2**64 either way, so the children's tokens are those of seed + i.
        seed = None if self.seed is None else _wrap64(self.seed + i)
        return dataclasses.replace(self, n=1, seed=seed)


def check_vocab(name: str, ids: Sequence[int], vocab_size: int) -> None:
    """ParamError naming every token id of `ids` outside [0, vocab_size) (a few, then how
    many more), for the field `name`."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        what = "token id {} is" if len(bad) == 1 else "token ids {} are"
        raise ParamError(name, f"{name}: {what.format(few(bad))} outside the vocabulary "
                         f"[0, {vocab_size})")


def _token_ids(value: object) -> tuple[int, ...]:
    # A str is a Sequence too; "123" is not a list of token ids.
    if isinstance(value, str | bytes) or not isinstance(value, list | tuple):
        raise ParamError(
            "stop_token_ids", f"stop_token_ids must be a list of token ids, got {value!r}"
        )
    bad = [f"[{i}] {v!r:.40}" for i, v in enumerate(value)
           if isinstance(v, bool) or not isinstance(v, int) or v < 0]
    if bad:
        raise ParamError("stop_token_ids", f"stop_token_ids must be integers >= 0 (each token "
                         f"id), got {few(bad)}")
    return tuple(value)


def _stop_strings(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    items = (value,) if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(s, str) for s in items):
        raise ParamError("stop", f"stop must be a string or a list of strings, got {value!r}")
    if len(items) > MAX_STOP_STRINGS:
        raise ParamError(
            "stop", f"stop allows at most {MAX_STOP_STRINGS} strings, got {len(items)}"
        )
    empty = [f"[{i}]" for i, s in enumerate(items) if s == ""]
    if empty:
        where = "" if isinstance(value, str) else f" ({few(empty)} empty)"
        raise ParamError("stop", f"stop strings must be non-empty, got {value!r:.80}{where}")
    return tuple(items)


def _logit_bias(value: object) -> dict[int, float]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ParamError(
            "logit_bias", f"logit_bias must be a map of token id to bias, got {value!r}"
        )
    # Every bad entry is named (a few, then how many more), keys first: a client fixing one
    # at a time would otherwise need a round trip per entry.
    out: dict[int, float] = {}
    keys: list[str] = []
    twice: list[int] = []
    biases: list[str] = []
    m = MAX_ABS_LOGIT_BIAS
    for key, bias in value.items():
        tok = _bias_key(key)
        if tok is None:
            keys.append(f"{key!r:.40}")
        elif tok in out:  # {"5": 1, 5: 2}: which one was meant?
            twice.append(tok)
        elif _in(bias, -m, m):
            out[tok] = float(bias)
        else:
            biases.append(f"{bias!r:.40} (bias of token {tok})")
            out[tok] = 0.0  # a placeholder, so a later duplicate is still seen
    if keys:
        raise ParamError("logit_bias", "logit_bias keys must be token ids >= 0 (int or decimal "
                         f"string), got {few(keys)}")
    if twice:
        ids = "token id" if len(twice) == 1 else "token ids"
        raise ParamError("logit_bias", f"logit_bias has {ids} {few(twice)} twice")
    if biases:
        raise ParamError("logit_bias", f"logit_bias values must be numbers in [{-m}, {m}], "
                         f"got {few(biases)}")
    return out


def _bias_key(key: Any) -> int | None:
    # The OpenAI API sends JSON object keys, hence strings; Python callers send ints.
    if isinstance(key, str) and _DECIMAL.fullmatch(key):
        return int(key)
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return key
    return None
