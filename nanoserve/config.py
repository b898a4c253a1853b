"""Engine settings: everything that changes the schedule, validated in one place.

Some combinations can only be judged against a model (its context length, the bytes one KV
block takes): `EngineConfig.layout` judges those, and needs only those two numbers, so
`nanoserve serve` checks a configuration before it binds a socket or loads a weight
(`nanoserve.model.kv_geometry` reads them from the model's metadata), and the engine checks
it again, with the same words, from the loaded model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

# The least context an unset max_model_len is cut to when the model's own does not fit the
# KV pool (Ollama's default context); a smaller pool is refused, as any pool that cannot
# hold one sequence of an explicit max_model_len is.
_SHORTEST_DEFAULT_CONTEXT = 4096


class ConfigError(ValueError):
    """An engine setting that cannot work; the message names the setting by its Python
    name (num_blocks), as `LLM(...)` and `sim --engine key=value` spell it."""

    def cli_text(self) -> str:
        """The message with nanoserve's command-line flags for the settings it names
        (`num_blocks` -> `--num-blocks`)."""
        return _FLAGGED.sub(lambda m: "--" + m.group(1).replace("_", "-"), str(self))


# The settings `nanoserve serve` (and some of them `nanoserve bench`) takes as flags.
_FLAGGED = re.compile(r"\b(block_size|num_blocks|kv_cache_memory|max_num_seqs|"
                      r"max_num_batched_tokens|max_model_len)\b")


SPEC_METHODS = ("ngram", "draft_model")
LOOKUP_MIN = 2  # the least n-gram where only prompt_lookup_max is given


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config`, as far as nanoserve has it: n-gram prompt lookup
    (`method` "ngram"), `num_speculative_tokens` proposed a step, from the longest n-gram
    of `prompt_lookup_min`..`prompt_lookup_max` tokens that ends the sequence and occurs
    earlier in it; or a draft model (`method` "draft_model", implied by `model` alone: a
    path or name as `nanoserve serve --model` takes, sharing the target's tokenizer) that
    proposes them by greedy decoding (engine/draft.py). `disable_by_batch_size` (vLLM's
    name): no proposals on a step with more decoding sequences than that (a wide batch is
    compute-bound, and k + 1 rows a sequence cost it k more). `adaptive`: each request's
    proposals as long as pays, by how its own have gone (engine/speculative.py's
    proposal_length; none where none pays); False proposes num_speculative_tokens wherever
    the n-gram (or the draft) has them, as vLLM does."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = LOOKUP_MIN
    prompt_lookup_max: int = 4
    disable_by_batch_size: int = 4
    adaptive: bool = True
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ConfigError("speculative_config.method must be one of "
                              f"{', '.join(SPEC_METHODS)}, got {self.method!r}")
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ConfigError(f"speculative_config.model must be a model's path or name, got "
                              f"{self.model!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ConfigError("speculative_config.model names the draft model of method "
                              "draft_model, and only of it")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                     "disable_by_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"speculative_config.{name} must be an integer >= 1, got "
                                  f"{value!r}")
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"speculative_config.adaptive must be true or false, got "
                              f"{self.adaptive!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) "
                              f"exceeds prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def parse(cls, text: str | dict[str, Any]) -> SpeculativeConfig:
        """From vLLM's JSON (or its dict). `prompt_lookup_max` alone leaves the least
        n-gram at 2 (or at the max, if lower)."""
        if isinstance(text, dict):
            fields = text
        else:
            try:
                fields = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(fields, dict):
            raise ConfigError("speculative_config must be a JSON object, got "
                              f"{type(fields).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ConfigError(f"speculative_config.{unknown[0]} is not supported (known: "
                              f"{', '.join(sorted(known))})")
        if "model" in fields and "method" not in fields:  # as vLLM infers it
            fields = {**fields, "method": "draft_model"}
        high = fields.get("prompt_lookup_max")
        if isinstance(high, int) and "prompt_lookup_min" not in fields:
            fields = {**fields, "prompt_lookup_min": min(high, LOOKUP_MIN)}
        return cls(**fields)

    def as_json(self) -> dict[str, Any]:
        """The fields `parse` takes back, without those left unset (a trace's header and a
        capacity report hold this: an n-gram config has no draft model's null)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def speculative_config_arg(text: str) -> SpeculativeConfig:
    """`--speculative-config` (serve's and bench's): vLLM's JSON, or argparse's one line."""
    try:
        return SpeculativeConfig.parse(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What a configuration comes to on one model: the pool's blocks, the longest sequence."""

    num_blocks: int
    max_model_len: int


@dataclass(frozen=True, slots=True)
class EngineConfig:
    block_size: int = 16
    # None: as many blocks as `kv_cache_memory` bytes hold (the stub, which keeps no KV,
    # gets `stub_num_blocks`).
    num_blocks: int | None = None
    kv_cache_memory: int = 1 << 30
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # None: the model's own context length.
    max_model_len: int | None = None
    prefix_caching: bool = True
    seed: int = 0
    stub_num_blocks: int = 1024
    # Speculative decoding (engine/speculative.py); None: one token a sequence a step.
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "stub_num_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("num_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ConfigError(f"{name} must be an integer >= 1 or unset, got {value!r}")
        if isinstance(self.kv_cache_memory, bool) or not isinstance(self.kv_cache_memory, int) \
                or self.kv_cache_memory < 1:
            raise ConfigError(f"kv_cache_memory must be a number of bytes > 0, got "
                              f"{self.kv_cache_memory!r}")
        # A request's seed is mixed from this one in 64 bits (seeds.mix64): a wider one would
        # alias another seed silently. vLLM's range.
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or \
                not -(1 << 63) <= self.seed < 1 << 63:
            raise ConfigError(f"seed must be a 64-bit signed integer, got {self.seed!r}")

    def layout(self, context_len: int, kv_bytes_per_block: int) -> KVLayout:
        """This configuration on a model of `context_len` tokens whose KV takes
        `kv_bytes_per_block` bytes a block (0: the stub, which keeps none). Refuses, as vLLM
        does, a pool that cannot hold one sequence of max_model_len: a server that admits a
        request it can never finish is broken at start-up, not at the first long prompt.
        Where max_model_len is unset, a model's context longer than the pool is cut to what
        the pool holds, if that is at least _SHORTEST_DEFAULT_CONTEXT tokens."""
        max_len = self.max_model_len or context_len
        if max_len > context_len:
            raise ConfigError(f"max_model_len {max_len} exceeds the model's context of "
                              f"{context_len} tokens: lower max_model_len")
        bs = self.block_size
        if bs > max_len:  # no sequence could fill one block (prefix caching keeps full ones)
            raise ConfigError(f"block_size {bs} exceeds max_model_len {max_len}: a block holds "
                              f"tokens of one sequence; lower block_size")
        if self.num_blocks is not None:
            num_blocks, pool = self.num_blocks, f"num_blocks {self.num_blocks}"
        elif kv_bytes_per_block > 0:
            num_blocks = self.kv_cache_memory // kv_bytes_per_block
            pool = (f"kv_cache_memory {self.kv_cache_memory} B / {kv_bytes_per_block} B a "
                    f"block = {num_blocks} blocks")
        else:
            num_blocks, pool = self.stub_num_blocks, f"the stub's {self.stub_num_blocks} blocks"
        if num_blocks * bs < max_len and not self.max_model_len and \
                num_blocks * bs >= _SHORTEST_DEFAULT_CONTEXT:
            # Unasked, serve what the pool holds (a Gemma 3's 32k or a Llama 3.1's 128k
            # context is more than the default 1 GiB pool), as llama.cpp serves its -c.
            log.warning("max_model_len: the model's context of %d tokens is more than the KV "
                        "pool holds; serving %d (raise kv_cache_memory for more)", max_len,
                        num_blocks * bs)
            max_len = num_blocks * bs
        if num_blocks * bs < max_len:
            whose = "" if self.max_model_len else " (the model's context)"
            raise ConfigError(
                f"the KV pool ({pool} x block_size {bs} = {num_blocks * bs} tokens) cannot hold "
                f"one sequence of max_model_len {max_len}{whose}: raise num_blocks or "
                f"kv_cache_memory, or lower max_model_len"
            )
        return KVLayout(num_blocks, max_len)
