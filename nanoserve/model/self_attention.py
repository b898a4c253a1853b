"""One layer's attention in the Python layer loop (llama.py's forward, where a step is not
one native decode-stack call): the fused qkv projection and its bias, the q and k norms,
RoPE and the KV cache's write, attention over the cache (attention.py), the o projection.
"""

from __future__ import annotations

import torch

from nanoserve.model import ops
from nanoserve.model.attention import AttentionPlan, attend
from nanoserve.model.base import ModelConfig
from nanoserve.model.native import Kernels
from nanoserve.model.placement import LayerWeights
from nanoserve.model.step import StepPlan


def self_attention(
    c: ModelConfig,
    layer: LayerWeights,
    h: torch.Tensor,  # [T, hidden]
    kv: torch.Tensor,  # [2, slots, KV, D]: this layer's K and V cache
    plan: StepPlan,
    attention: AttentionPlan,  # full, or windowed on a sliding-window layer
    kernels: Kernels | None,  # the model's: native decode attention's (attention.py)
    native: Kernels | None,  # the elementwise ops' kernels: None on the stock path
) -> torch.Tensor:
    """The layer's attention output [T, hidden] (before a tensor-parallel reduce)."""
    shape = (c.num_heads, c.num_kv_heads, c.head_dim)
    qkv = layer.qkv(h)
    if layer.qkv_bias is not None:
        qkv += layer.qkv_bias
    if layer.q_norm is not None and layer.k_norm is not None:
        ops.norm_qk_heads(qkv, shape, layer.q_norm, layer.k_norm, c.rms_norm_eps,
                          native=native)
    cos, sin = plan.rope(layer.local_rope)
    q, k, v = ops.rope_store(qkv, shape, cos, sin, plan.positions,
                             plan.slot_mapping, kv[0], kv[1], native=native)
    out = attend(q, k, v, kv[0], kv[1], attention, kernels)  # [T, H, D]
    return layer.o(out.view(h.shape[0], -1))  # [T, hidden]
