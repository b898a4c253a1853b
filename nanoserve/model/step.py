"""One step's inputs to the Llama forward, prepared once and shared by every layer: the
batch's lists as index tensors on the device, the RoPE rows for its positions, and the
attention plans (model/attention.py): the full one, and the one the sliding-window layers
use (the same object where the model has no window or no row's context exceeds it).

Apart from the forward (llama.py) because it is the step's bookkeeping, not its arithmetic:
host lists turned into device tensors, one host-to-device copy each and no syncs, before
any layer runs. RoPE's tables live here too: built once per model, indexed here per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nanoserve.model.attention import AttentionPlan, plan_attention, windowed
from nanoserve.model.base import ForwardBatch, ModelConfig, RopeScaling


@dataclass(slots=True)
class StepPlan:
    """Everything a step needs besides the weights, built once and shared by all layers."""

    input_ids: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    cos: torch.Tensor  # native: the model's [P, D] table; stock: [T, 1, D] for these tokens
    sin: torch.Tensor
    logits_indices: torch.Tensor  # [R]
    attention: AttentionPlan
    # the same from the local RoPE table, where the model has one (Gemma's sliding layers)
    local_cos: torch.Tensor | None = None
    local_sin: torch.Tensor | None = None
    # the plan of the layers in `window_layers` (the config's sliding-window layers)
    windowed_attention: AttentionPlan | None = None
    window_layers: frozenset[int] = frozenset()

    def attention_for(self, layer: int) -> AttentionPlan:
        """The attention plan layer `layer` runs with: windowed or full."""
        if layer in self.window_layers:
            assert self.windowed_attention is not None
            return self.windowed_attention
        return self.attention

    def rope(self, local: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos and sin a layer rotates q and k by: local or global."""
        if not local:
            return self.cos, self.sin
        assert self.local_cos is not None
        assert self.local_sin is not None
        return self.local_cos, self.local_sin


def plan_step(b: ForwardBatch, config: ModelConfig, cache: torch.Tensor, block_size: int,
              cos: torch.Tensor, sin: torch.Tensor, *, stock: bool, native_attention: bool,
              group_bytes: int, device: torch.device,
              local_rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> StepPlan:
    """Turn the batch's lists into index tensors: one host-to-device copy each, no syncs.
    `cos` and `sin` are the model's RoPE tables (rope_tables), `local_rope` its local ones
    if any; `stock`: the layers run on stock PyTorch ops, which take the rows of these
    positions rather than the tables."""
    if len(b.input_ids) != sum(b.query_lens) or len(b.query_lens) != len(b.block_tables):
        raise ValueError("ForwardBatch: input_ids, query_lens and block_tables disagree")
    c = config

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    positions = tensor(b.positions)

    def rows(table: torch.Tensor) -> torch.Tensor:
        return table[positions][:, None, :] if stock else table

    row_bytes = block_size * c.num_kv_heads * c.head_dim * cache.element_size()
    attention = plan_attention(b, block_size=block_size, kv_row_bytes=row_bytes,
                               group_bytes=group_bytes, native=native_attention,
                               device=device, scale=c.attention_scale)
    return StepPlan(
        input_ids=tensor(b.input_ids),
        slot_mapping=tensor(b.slot_mapping),
        positions=positions,
        cos=rows(cos),
        sin=rows(sin),
        logits_indices=tensor(b.logits_indices),
        attention=attention,
        local_cos=None if local_rope is None else rows(local_rope[0]),
        local_sin=None if local_rope is None else rows(local_rope[1]),
        windowed_attention=windowed(attention, b, c.sliding_window),
        window_layers=frozenset(c.window_layers),
    )


def rope_tables(config: ModelConfig, device: torch.device, dtype: torch.dtype, *,
                local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos and sin for every position, once: pos * theta^(-2i/D) in float32 (the
    product is exact to one rounding, as in the reference), duplicated for rotate_half.
    `local`: with the base of Gemma's sliding-window layers, which no scaling touches (in
    transformers' Gemma 3 the scaling is the global layers')."""
    d = config.head_dim
    theta = config.local_rope_theta if local else config.rope_theta
    assert theta is not None, "local RoPE tables need a config with local_rope_theta"
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)  # [D/2]
    if config.rope_scaling is not None and not local:
        inv_freq = llama3_frequencies(inv_freq, config.rope_scaling)
    if config.rope_linear_factor is not None and not local:
        inv_freq = inv_freq / config.rope_linear_factor
    pos = torch.arange(config.max_position_embeddings, dtype=torch.float32)
    angles = torch.outer(pos, inv_freq)
    angles = torch.cat((angles, angles), dim=-1)  # [P, D]
    return angles.cos().to(device, dtype), angles.sin().to(device, dtype)


def llama3_frequencies(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1's scaled RoPE frequencies: long wavelengths (beyond the original context
    over low_freq_factor) slowed by `factor`, short ones (under it over high_freq_factor)
    kept, and in between a linear blend of the two in the context-to-wavelength ratio."""
    ctx = float(s.original_max_position_embeddings)
    wavelen = 2 * math.pi / inv_freq
    ratio = ctx / wavelen  # how many wavelengths fit in the original context
    blend = (ratio - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - blend) * inv_freq / s.factor + blend * inv_freq
    out = torch.where(wavelen > ctx / s.low_freq_factor, inv_freq / s.factor, inv_freq)
    middle = (wavelen >= ctx / s.high_freq_factor) & (wavelen <= ctx / s.low_freq_factor)
    return torch.where(middle, blended, out)
