"""A Llama layer's elementwise parts, each as one native kernel or as stock PyTorch ops.

`native=` one instruction set's loaded kernels (model/native.py) calls nanoserve's fused CPU
kernels (model/csrc/layers.cpp: one pass and one dispatch each, float32 only); `native=None`
is the same arithmetic in PyTorch operators, for every other device and dtype, and for
machines where the kernels could not be built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve.model.native import Kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, native: Kernels | None
             ) -> torch.Tensor:
    if native is not None:
        out = torch.empty_like(x)
        native.ops.rms_norm(x, weight, eps, out)
        return out
    # In float32 whatever the model dtype, then back, as the reference does: the mean of
    # squares of 576 bf16 values loses too much otherwise.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def norm_qk_heads(qkv: torch.Tensor, shape: tuple[int, int, int], q_norm: torch.Tensor,
                  k_norm: torch.Tensor, eps: float, *, native: Kernels | None) -> None:
    """Qwen3 and Gemma 3: every q and k head of `qkv` [T, (H + 2 KV) * D] RMS-normed over
    its D values, in place, before RoPE (v is left as it is)."""
    nh, nkv, d = shape
    if native is not None:
        native.ops.norm_qk_heads(qkv, q_norm, k_norm, nh, nkv, eps)
        return
    t = qkv.shape[0]
    for start, heads, weight in ((0, nh, q_norm), (nh * d, nkv, k_norm)):
        part = qkv[:, start:start + heads * d]
        part.copy_(rms_norm(part.reshape(t, heads, d), weight, eps, native=None)
                   .reshape(t, heads * d))


def norm_if(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *,
            native: Kernels | None) -> torch.Tensor:
    """x normed by `weight`, or x as it is where there is none (Gemma's norms of the
    attention and MLP outputs, which other architectures lack)."""
    return x if weight is None else rms_norm(x, weight, eps, native=native)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 native: Kernels | None) -> torch.Tensor:
    """The residual add, in place (x += delta), and the next norm of its result."""
    if native is not None:
        out = torch.empty_like(x)
        native.ops.add_rms_norm(x, delta, weight, eps, out)
        return out
    x.add_(delta)
    return rms_norm(x, weight, eps, native=None)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    # Pairs dimension i with i + D/2 (the Hugging Face layout the loader converts to).
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_store(
    qkv: torch.Tensor,  # [T, (H + 2 KV) * D]
    shape: tuple[int, int, int],  # H, KV, D
    cos: torch.Tensor,  # native: the [P, D] table; stock: [T, 1, D] for these tokens
    sin: torch.Tensor,
    positions: torch.Tensor,  # [T]
    slot_mapping: torch.Tensor,  # [T]
    k_cache: torch.Tensor,  # [slots, KV, D]
    v_cache: torch.Tensor,
    *,
    native: Kernels | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q and k rotated, k and v written to their cache slots; returns q [T, H, D] and
    k, v [T, KV, D] for attention to read this step's own keys from."""
    nh, nkv, d = shape
    t = qkv.shape[0]
    v = qkv[:, (nh + nkv) * d:].view(t, nkv, d)
    if native is not None:
        q = qkv.new_empty((t, nh, d))
        k = qkv.new_empty((t, nkv, d))
        native.ops.rope_store(qkv, cos, sin, positions, slot_mapping, k_cache,
                                       v_cache, q, k)
        return q, k, v
    qs, ks = qkv[:, : nh * d].view(t, nh, d), qkv[:, nh * d : (nh + nkv) * d].view(t, nkv, d)
    q = qs * cos + rotate_half(qs) * sin
    k = ks * cos + rotate_half(ks) * sin
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)
    return q, k, v


def gate_mul(gate_up: torch.Tensor, *, gelu: bool, native: Kernels | None) -> torch.Tensor:
    """act(gate) * up: silu (silu_mul), or for Gemma gelu's tanh approximation."""
    if not gelu:
        return silu_mul(gate_up, native=native)
    if native is not None:
        out = gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))
        native.ops.gelu_tanh_mul(gate_up, out)
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def silu_mul(gate_up: torch.Tensor, *, native: Kernels | None) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dimension."""
    if native is not None:
        out = gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))
        native.ops.silu_mul(gate_up, out)
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
