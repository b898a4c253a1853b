"""Tensor-parallel sharding of a Llama's weights, as vLLM and nano-vllm lay it out.

Rank r of N holds:
- q: heads [r*H/N, (r+1)*H/N), column-parallel (rows of q_proj);
- k, v: KV heads [r*KV/N, ...) when N divides KV; when KV divides N instead, every rank holds
  one KV head, r // (N/KV), replicated over the N/KV ranks whose query heads use it (vLLM's
  rule). Either way rank r's query heads read only its own KV heads, so attention needs no
  communication and each rank's KV cache holds only its heads;
- gate and up: rows [r*I/N, (r+1)*I/N) of each, taken apart before they are fused, so the
  fused [gate_r; up_r] still splits in half (a split of the fused [gate; up] would give the
  first ranks all of gate);
- o and down: the matching input columns (row-parallel), whose partial outputs are summed
  over the ranks (an all-reduce) before the residual add;
- embedding, norms and LM head: replicated (every rank needs the residual stream whole; only
  rank 0 runs the head).

Every sharded size must divide exactly: a truncated split gives logits that look plausible
and are wrong, so `check_tp_size` refuses and names the sizes that would work.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from nanoserve.model.base import ModelConfig
from nanoserve.model.quant import FORMATS, QuantWeight

Weight = torch.Tensor | QuantWeight


def _problems(config: ModelConfig, n: int) -> list[str]:
    c = config
    out = []
    if c.num_heads % n:
        out.append(f"{c.num_heads} attention heads")
    if c.num_kv_heads % n and n % c.num_kv_heads:
        out.append(f"{c.num_kv_heads} KV heads (N must divide them or be a multiple of them)")
    if c.intermediate_size % n:
        out.append(f"intermediate size {c.intermediate_size}")
    return out


def valid_tp_sizes(config: ModelConfig) -> list[int]:
    """Every N at which this model shards exactly (up to its head count)."""
    return [n for n in range(1, config.num_heads + 1) if not _problems(config, n)]


def check_tp_size(config: ModelConfig, n: int, field: str = "tensor_parallel_size") -> None:
    """ValueError, in one line naming the sizes that work, unless N shards exactly."""
    if n < 1:
        raise ValueError(f"{field} must be >= 1, got {n}")
    if n > 1 and not config.plain_llama:
        raise ValueError(f"{field}: {config.architecture}'s departures from Llama (biases, "
                         "head norms, extra norms) are not sharded; this model runs at 1")
    bad = _problems(config, n)
    if bad:
        sizes = ", ".join(map(str, valid_tp_sizes(config)))
        raise ValueError(f"{field} {n} does not divide {'; '.join(bad)}; "
                         f"this model shards at {sizes}")


def local_config(config: ModelConfig, n: int) -> ModelConfig:
    """The shapes one rank computes with: its heads, its KV heads, its MLP slice."""
    return dataclasses.replace(
        config, num_heads=config.num_heads // n,
        num_kv_heads=max(config.num_kv_heads // n, 1),
        intermediate_size=config.intermediate_size // n)


def kv_heads_of(config: ModelConfig, rank: int, n: int) -> range:
    """The KV heads rank `rank` of `n` holds (replicated when N > KV)."""
    kv = config.num_kv_heads
    if kv % n == 0:
        per = kv // n
        return range(rank * per, (rank + 1) * per)
    head = rank // (n // kv)
    return range(head, head + 1)


def rows(w: Weight, start: int, stop: int) -> Weight:
    """Output rows [start, stop) of a [out, in] weight (not yet fused: one format)."""
    if isinstance(w, QuantWeight):
        assert not w.parts, "shard before fusing: a mixed weight's rows are its parts'"
        return QuantWeight(w.blocks[start:stop].contiguous(), w.format, w.cols)
    return w[start:stop].contiguous()


def cols(w: Weight, start: int, stop: int) -> Weight:
    """Input columns [start, stop) of a [out, in] weight. Quantized blocks hold 32 columns
    each, a K-quant's 256 (quant.FORMATS): a cut inside a block dequantizes that weight to
    float32 instead, as it would be without a kernel."""
    if isinstance(w, QuantWeight):
        assert not w.parts, "shard before fusing: a mixed weight's rows are its parts'"
        f = FORMATS[w.format]
        if start % f.weights == 0 and stop % f.weights == 0:
            a, b = start // f.weights * f.bytes, stop // f.weights * f.bytes
            return QuantWeight(w.blocks[:, a:b].contiguous(), w.format, stop - start)
        w = w.dequantize()
    return w[:, start:stop].contiguous()


def shard_weights(config: ModelConfig, weights: Mapping[str, Weight], rank: int, n: int
                  ) -> tuple[ModelConfig, dict[str, Weight]]:
    """Rank `rank`'s (local config, weights) of an N-way split (module docstring)."""
    check_tp_size(config, n)
    if not 0 <= rank < n:
        raise ValueError(f"rank {rank} is not in 0..{n - 1}")
    c, d = config, config.head_dim
    hq = c.num_heads // n
    kv = kv_heads_of(c, rank, n)
    inter = c.intermediate_size // n
    out: dict[str, Weight] = dict(weights)  # norms, embedding, head: replicated
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        q0 = rank * hq * d
        out[p + "self_attn.q_proj.weight"] = rows(weights[p + "self_attn.q_proj.weight"],
                                                  q0, q0 + hq * d)
        for name in ("k_proj", "v_proj"):
            key = p + f"self_attn.{name}.weight"
            out[key] = rows(weights[key], kv.start * d, kv.stop * d)
        out[p + "self_attn.o_proj.weight"] = cols(weights[p + "self_attn.o_proj.weight"],
                                                  q0, q0 + hq * d)
        for name in ("gate_proj", "up_proj"):
            key = p + f"mlp.{name}.weight"
            out[key] = rows(weights[key], rank * inter, (rank + 1) * inter)
        key = p + "mlp.down_proj.weight"
        out[key] = cols(weights[key], rank * inter, (rank + 1) * inter)
    return local_config(c, n), out
