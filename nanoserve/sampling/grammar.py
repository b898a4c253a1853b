"""Structured outputs: a request's constraint (JSON schema, regex, choice, Lark grammar)
compiled by llguidance into a matcher that names, before each draw, the tokens the
constraint allows.

llguidance, not xgrammar, measured against each other on SmolLM2's tokenizer (2 shared
cores, 13 grammars, medians of 3): cold compile 0.8 ms median and 1.6 ms worst against
3.5 ms and 433 ms (xgrammar's string lengths and bounded repetitions took 0.14-1.3 s, which
per-request schemas make the common case); a row's mask 26 us mean against 8 us, 16 rows of
32 filled in 92 us against 314 us; and xgrammar 0.2.8 let SmolLM2's special tokens into
JSON strings and emitted raw control characters under maxLength (its issues #832, #800).
llguidance installs as one wheel; xgrammar requires triton.

The engine's side (engine.py, runner.py, sampler.py):
- `Grammars.check(spec)` compiles at admission (`Engine.prepare`, off the step; cached by
  spec): a constraint that does not compile is a ParamError naming the request's field.
- Each constrained request gets its own matcher the first time it samples (siblings of an
  n > 1 request and a request resumed after preemption included: the matcher replays the
  request's output tokens, none in the first case, all of them in the second's rebuild).
- Before the draw, the runner asks every constrained row's matcher for its bitmask; the
  sampler turns disallowed tokens to -inf after penalties, bias and min_tokens, so one
  step mixes constrained and free rows and a free row's numbers do not change.
- The update phase advances the matcher with the drawn token. EOS is allowed only where
  the constraint can end; once it cannot go on (`is_stopped`), the request stops there.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

import torch

from nanoserve.sampling.schema_finite import has_finite_instance
from nanoserve.tokenizer import Tokenizer

KINDS = ("json", "regex", "choice", "grammar")
# JSON's layout under a schema: `{"a": 1, "b": [2, 3]}`, one space after ':' and ',' and no
# other whitespace. llguidance's default allows any run of whitespace between tokens, and a
# sampled model (the stub always, SmolLM2 at times) can spend its whole max_tokens on it,
# which is why vLLM grew --disable-any-whitespace. A schema's own "x-guidance" overrides.
JSON_LAYOUT: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A constraint that does not compile; `field` is the request field that gave it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class GuidedSpec:
    """One constraint, hashable (its source is canonical text), so compiles are cached."""

    kind: str  # json | regex | choice | grammar (Lark, llguidance's dialect)
    source: str  # JSON schema text, the regex, a JSON list of choices, or the grammar
    field: str = "response_format"  # the request field it came from, for errors

    @staticmethod
    def json_schema(schema: Any, field: str = "response_format") -> GuidedSpec:
        # Key order kept: it is the order the properties are generated in.
        return GuidedSpec("json", json.dumps(schema, separators=(",", ":")), field)

    @staticmethod
    def choice(options: list[str], field: str = "guided_choice") -> GuidedSpec:
        return GuidedSpec("choice", json.dumps(list(options)), field)

    def grammar_text(self) -> str:
        from llguidance import LLMatcher

        if self.kind == "json":
            schema = json.loads(self.source)
            if not has_finite_instance(schema):
                raise ValueError("no finite JSON value satisfies this schema: a required "
                                 "property or item leads back into it without end")
            text: str = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        elif self.kind == "regex":
            text = LLMatcher.grammar_from_regex(self.source)
        elif self.kind == "choice":
            options = json.loads(self.source)
            alternatives = " | ".join(json.dumps(o) for o in options)
            text = LLMatcher.grammar_from_lark(f"start: {alternatives}")
        elif self.kind == "grammar":
            text = LLMatcher.grammar_from_lark(self.source)
        else:
            raise GrammarError(self.field, f"unknown constraint kind {self.kind!r}")
        return text


class Grammars:
    """Compiled constraints for one tokenizer and logits width: a pristine matcher per spec,
    copied for each request."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size

    @functools.cached_property
    def _lltok(self) -> Any:
        """llguidance's view of the vocabulary: built once (about 0.35 s for SmolLM2's)."""
        from llguidance import LLTokenizer

        return LLTokenizer(self._tokenizer.to_json(), n_vocab=self.vocab_size,
                           eos_token=list(self._tokenizer.eos_token_ids))

    def check(self, spec: GuidedSpec) -> None:
        """Compile (or find compiled) `spec`; GrammarError if it does not compile. The
        serving task calls this (Engine.prepare) while a step may run in its thread; no lock
        is held while compiling, so the step's `matcher` calls never wait on a compile (two
        threads may compile one spec at once, and one result is kept: harmless)."""
        self._compile(spec)

    def matcher(self, spec: GuidedSpec) -> Any:
        """A fresh matcher at the start of `spec` (llguidance's LLMatcher)."""
        return self._compile(spec).deep_copy()

    @functools.lru_cache(maxsize=256)  # noqa: B019 (one Grammars per engine, kept for its life)
    def _compile(self, spec: GuidedSpec) -> Any:
        from llguidance import LLMatcher

        try:
            text = spec.grammar_text()
        except (ValueError, TypeError, RuntimeError, RecursionError) as exc:
            raise GrammarError(spec.field, f"{spec.field}: {exc}") from None
        try:
            m = LLMatcher(self._lltok, text)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise GrammarError(spec.field, f"{spec.field}: {exc}") from None
        if m.is_error():
            raise GrammarError(spec.field, f"{spec.field}: {m.get_error()}")
        return m


def apply_bitmasks(x: torch.Tensor, rows: list[int], masks: list[bytes]) -> torch.Tensor:
    """Set every token a row's bitmask does not allow to -inf, in place on `x` [R, V].
    A mask is llguidance's: little-endian 32-bit words, bit j of word w for token 32w + j."""
    if not rows:
        return x
    v = x.shape[1]
    words = torch.frombuffer(bytearray(b"".join(masks)), dtype=torch.int32)
    words = words.view(len(rows), -1).to(x.device)
    shifts = torch.arange(32, dtype=torch.int32, device=x.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, :v].bool()
    idx = torch.tensor(rows, dtype=torch.long, device=x.device)
    x[idx] = x[idx].masked_fill(~allowed, float("-inf"))
    return x
