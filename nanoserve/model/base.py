"""What every model (real Llama weights or the stub) offers the engine.

The engine hands a model one flat batch per step: the new tokens of every scheduled
sequence concatenated in row order (prefill chunks and single decode tokens side by side),
with the cache slot each token's K/V goes to and each row's block table. The model returns
logits only at the flat positions the engine asks for (normally each row's last token), so
a chunked prefill that is not finished yet costs no LM-head work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama 3.1's RoPE scaling (`rope_type: llama3`): frequencies whose wavelength exceeds
    the original context divided by `low_freq_factor` are divided by `factor`, those below
    it divided by `high_freq_factor` kept, and those between blended smoothly."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shape of a Llama-family model (what config.json says, in our names)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Where an architecture departs from Llama 2 (model/architectures.py reads these from the
    # checkpoint's config): its name, biases on the q/k/v projections (Qwen2), an RMSNorm of
    # each q and k head before RoPE (Qwen3, Gemma 3), Llama 3.1's RoPE frequency scaling,
    # and `rope_type: linear`'s (every frequency divided by the factor: Gemma 3 4B and up).
    architecture: str = "llama"
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: RopeScaling | None = None
    rope_linear_factor: float | None = None
    # Gemma 3's: RMSNorms that scale by (1 + w) (folded into the weights at load), a norm of
    # the attention and of the MLP output before each residual add, gelu (tanh) instead of
    # silu on the gate, embeddings times sqrt(hidden), q.k scaled by query_pre_attn_scalar
    # ** -0.5, and the layers in `local_layers` rotated with RoPE base `local_rope_theta`.
    norm_plus_one: bool = False
    sandwich_norms: bool = False
    gelu_mlp: bool = False
    embed_scale: bool = False
    query_pre_attn_scalar: float | None = None
    local_rope_theta: float | None = None
    local_layers: tuple[int, ...] = ()
    # Sliding-window attention (Mistral, Gemma 3's local layers, Qwen with use_sliding_window):
    # on the layers in `window_layers`, the query at position p sees the key at j only when
    # p - j < sliding_window (the current token counts: at most `window` keys). None and ()
    # where no layer has a window, or where it is no shorter than the context and never binds.
    sliding_window: int | None = None
    window_layers: tuple[int, ...] = ()

    @property
    def plain_llama(self) -> bool:
        """No departure that the tensor-parallel shards lack."""
        return not (self.qkv_bias or self.qk_norm or self.norm_plus_one or self.sandwich_norms
                    or self.gelu_mlp or self.embed_scale or self.local_layers
                    or self.window_layers or self.query_pre_attn_scalar is not None)

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by before the softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def kv_bytes_per_token(self, elem_size: int) -> int:
        """KV-cache bytes one token takes: K and V, every layer, every KV head."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * elem_size


class ModelLost(RuntimeError):
    """The model can run no further step (a tensor-parallel rank died or hung). The engine
    lets it through instead of failing only that step's requests, so the serving loop dies
    on its usual path: every request ends with the error, /health answers 503.

    A model that can be lost between steps too (tensor parallelism: a rank that dies or
    goes silent while the server is idle) also offers `on_lost(fn)`, and calls fn(reason)
    once, from a thread of its own, when it is (the serving bridge listens)."""


class ModelStartError(RuntimeError):
    """The model could not start (a tensor-parallel rank that exited or never joined), for a
    reason its message says in full: callers report it in one line, not as a traceback."""


@dataclass(slots=True)
class ForwardBatch:
    """One step's work, as plain Python lists (the model moves them to its device).

    T is the number of new tokens in the step, B the number of rows (sequences).
    """

    input_ids: list[int]  # [T] new tokens of all rows, concatenated in row order
    positions: list[int]  # [T] position of each token in its own sequence
    slot_mapping: list[int]  # [T] cache slot (block_id * block_size + offset) for its K/V
    query_lens: list[int]  # [B] new tokens of each row this step
    context_lens: list[int]  # [B] tokens of each row in the cache after this step
    block_tables: list[list[int]]  # [B] the blocks each row's context lives in, in order
    logits_indices: list[int]  # [R] flat token indices whose logits are wanted
    # The stub's logits are a function of (seed, history); real weights ignore these two.
    histories: list[Sequence[int]] = field(default_factory=list)  # [B] tokens incl. this step's
    seeds: list[int] = field(default_factory=list)  # [B]


class Model(Protocol):
    """A causal LM over a paged KV cache that it owns."""

    config: ModelConfig
    device: torch.device

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocate the KV cache for `num_blocks` blocks of `block_size` tokens."""
        ...

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes of KV cache one block takes (all layers, K and V)."""
        ...

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy the KV of block `src` into block `dst` for each (src, dst) pair."""
        ...

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run one step; returns float32 logits [R, vocab] at `batch.logits_indices`."""
        ...

    def pick_greedy(self, batch: ForwardBatch) -> list[int] | None:
        """Run one step and return each logits row's argmax without the logits, when the
        model can name it more cheaply than `forward` (the stub: simulation runs millions of
        greedy rows); None, having done nothing, when it cannot (real weights). The engine
        asks only when every row would take a plain argmax."""
        ...
