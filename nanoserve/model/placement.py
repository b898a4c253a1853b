"""A Llama checkpoint's tensors placed for the forward: on the model's device, fused, and in
the form its kernels run (float32, MKL-packed, or quantized blocks).

Apart from the forward (llama.py) because it runs once, when the model is built: which form
each weight takes is decided here, from the kernels the model chose, and the forward only
calls the projections it is handed. The decode stack's per-layer lists (csrc/stack.cpp) are
gathered here too, once, for the same reason.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import cast

import torch

from nanoserve.model.base import ModelConfig
from nanoserve.model.linear import Proj
from nanoserve.model.native import Kernels
from nanoserve.model.quant import QuantProj, QuantWeight, Scratch


@dataclass(slots=True)
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    qkv: Proj | QuantProj  # hidden -> (H + 2 KV) * D: q, k and v projections fused
    o: Proj | QuantProj  # H * D -> hidden
    mlp_norm: torch.Tensor  # [hidden] (Gemma's pre_feedforward_layernorm)
    gate_up: Proj | QuantProj  # hidden -> 2 I: gate and up projections fused
    down: Proj | QuantProj  # I -> hidden
    qkv_bias: torch.Tensor | None = None  # [(H + 2 KV) * D]: Qwen2's q, k and v biases
    q_norm: torch.Tensor | None = None  # [D]: Qwen3's RMSNorm weight of every q head
    k_norm: torch.Tensor | None = None  # [D]: and of every k head
    # [hidden]: Gemma's norms of the attention output and of the MLP output, each before its
    # residual add
    post_attn_norm: torch.Tensor | None = None
    post_mlp_norm: torch.Tensor | None = None
    local_rope: bool = False  # rotated by the local RoPE table (Gemma's sliding layers)


@dataclass(slots=True)
class PlacedWeights:
    # [vocab, hidden]: float32 (embed), or its quantized rows (embed_q), dequantized as they
    # are looked up; the other is None
    embed: torch.Tensor | None
    embed_q: QuantWeight | None
    norm: torch.Tensor  # [hidden], the final norm
    lm_head: Proj | QuantProj  # hidden -> vocab
    layers: list[LayerWeights]
    # what the looked-up embeddings are multiplied by (Gemma: sqrt(hidden), rounded to the
    # model's dtype as transformers rounds it); None: nothing
    embed_scale: float | None = None


@dataclass(frozen=True, slots=True)
class Placement:
    """Where and in what form the weights go, decided once from the device and dtype."""

    device: torch.device
    dtype: torch.dtype
    kernels: Kernels | None
    quantized: bool  # quantized weights stay quantized (else they are dequantized)
    pack_weights: bool


def place_weights(config: ModelConfig, weights: Mapping[str, torch.Tensor | QuantWeight],
                  where: Placement) -> PlacedWeights:
    """The embedding, the final norm, the head and every layer, from the checkpoint's
    tensors: float32 where they are, quantized where a kernel runs them here."""

    def w(name: str, dtype: torch.dtype = where.dtype) -> torch.Tensor:
        t = weights[name]
        t = t.dequantize(where.kernels) if isinstance(t, QuantWeight) else t
        return t.to(device=where.device, dtype=dtype)

    def norm(name: str) -> torch.Tensor:
        # Gemma's RMSNorm scales by (1 + w) computed in float32: folded here, once, so that
        # every norm is the plain rms_norm (exact in float32; bf16 rounds 1 + w once more).
        if config.norm_plus_one:
            return (w(name, torch.float32) + 1.0).to(where.dtype)
        return w(name)

    scratch = Scratch()  # what large batches dequantize a weight into, shared

    def proj(names: list[str]) -> Proj | QuantProj:
        return _fused([weights[n] for n in names], scratch, where)

    embed = weights["model.embed_tokens.weight"]
    embed_q = embed if where.quantized and isinstance(embed, QuantWeight) else None
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    sandwich = config.sandwich_norms
    return PlacedWeights(
        embed=None if embed_q is not None else w("model.embed_tokens.weight"),
        embed_q=embed_q,
        norm=norm("model.norm.weight"),
        lm_head=proj([head]),
        layers=[LayerWeights(
            attn_norm=norm(p + "input_layernorm.weight"),
            qkv=proj([p + f"self_attn.{x}_proj.weight" for x in "qkv"]),
            o=proj([p + "self_attn.o_proj.weight"]),
            mlp_norm=norm(p + ("pre_feedforward_layernorm.weight" if sandwich
                               else "post_attention_layernorm.weight")),
            gate_up=proj([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
            down=proj([p + "mlp.down_proj.weight"]),
            qkv_bias=(torch.cat([w(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
                      if config.qkv_bias else None),
            q_norm=norm(p + "self_attn.q_norm.weight") if config.qk_norm else None,
            k_norm=norm(p + "self_attn.k_norm.weight") if config.qk_norm else None,
            post_attn_norm=norm(p + "post_attention_layernorm.weight") if sandwich else None,
            post_mlp_norm=norm(p + "post_feedforward_layernorm.weight") if sandwich else None,
            local_rope=i in config.local_layers,
        ) for i, p in ((i, f"model.layers.{i}.") for i in range(config.num_layers))],
        embed_scale=(float(torch.tensor(config.hidden_size**0.5).to(where.dtype))
                     if config.embed_scale else None),
    )


def _fused(parts: list[torch.Tensor | QuantWeight], scratch: Scratch, where: Placement
           ) -> Proj | QuantProj:
    """Several weights fused along the output: quantized where every part is (each in its
    own format: a GGUF mixes them, Gemma 3's Q4_K_M has q and k in Q5_0 and v in Q8_0, and
    a fused MIXED weight runs each part's kernel into its own columns), else float32."""
    quant = [q for q in parts if isinstance(q, QuantWeight)]
    if where.quantized and len(quant) == len(parts):
        return QuantProj(QuantWeight.cat(quant), scratch, where.kernels).with_panels()
    dense = [q.dequantize(where.kernels) if isinstance(q, QuantWeight) else q for q in parts]
    return Proj(torch.cat(dense).to(device=where.device, dtype=where.dtype),
                pack=where.pack_weights)


@dataclass(frozen=True, slots=True)
class DecodeStack:
    """The decode stack's weights (csrc/stack.cpp), gathered once: the same lists every
    decode step. Every projection is its pieces (one per block format, each writing its own
    columns), flat over the layers in the order qkv, o, gate_up, down, `counts` pieces each;
    the optional per-layer parts are empty lists where no layer has them."""

    attn_norm: list[torch.Tensor]
    mlp_norm: list[torch.Tensor]
    post_attn_norm: list[torch.Tensor | None]
    post_mlp_norm: list[torch.Tensor | None]
    qkv_bias: list[torch.Tensor | None]
    q_norm: list[torch.Tensor | None]
    k_norm: list[torch.Tensor | None]
    blocks: list[torch.Tensor]
    formats: list[str]
    counts: list[int]
    local_rope: list[int]  # 1 where the layer rotates by the local RoPE table
    # Each piece's panels (model/panels.py), None where it has none, and the row counts
    # they run at.
    panel_q: list[torch.Tensor | None]
    panel_scales: list[torch.Tensor | None]
    panel_offsets: list[torch.Tensor | None]
    panel_rows: range

    def args(self, rows: int) -> tuple[object, ...]:
        """The op's weight arguments for a step of `rows` rows, in its order (after x). The
        panels only where they run (`rows` in panel_rows); elsewhere their lists are left
        empty, not converted for nothing on every batch-1 step."""
        on = rows in self.panel_rows
        return (self.attn_norm, self.mlp_norm, self.post_attn_norm, self.post_mlp_norm,
                self.qkv_bias, self.q_norm, self.k_norm, self.blocks, self.formats,
                self.counts, *((self.panel_q, self.panel_scales, self.panel_offsets)
                               if on else ([], [], [])))


def decode_stack_weights(layers: list[LayerWeights], usable: bool) -> DecodeStack | None:
    """The decode stack's weights: a decode-only step runs every layer in one native call
    (csrc/stack.cpp) when every projection is quantized (in any of the kernels' formats,
    mixed too) and the model can run it at all (`usable`): the same kernels in the same
    order as the per-layer path, without a few hundred calls from Python. None where the
    stack does not run, as where a projection is float32."""
    projs = [p for ly in layers for p in (ly.qkv, ly.o, ly.gate_up, ly.down)]
    if not usable or not all(isinstance(p, QuantProj) for p in projs):
        return None
    quant = [cast(QuantProj, p) for p in projs]
    pieces = [w for p in quant for _, w in p.weight.pieces()]
    panels = [pan for p in quant for pan in (p.panels or [None] * len(p.pieces))]

    def optional(get: Callable[[LayerWeights], torch.Tensor | None]
                 ) -> list[torch.Tensor | None]:
        values = [get(ly) for ly in layers]
        return values if any(v is not None for v in values) else []

    return DecodeStack(
        attn_norm=[ly.attn_norm for ly in layers], mlp_norm=[ly.mlp_norm for ly in layers],
        post_attn_norm=optional(lambda ly: ly.post_attn_norm),
        post_mlp_norm=optional(lambda ly: ly.post_mlp_norm),
        qkv_bias=optional(lambda ly: ly.qkv_bias), q_norm=optional(lambda ly: ly.q_norm),
        k_norm=optional(lambda ly: ly.k_norm),
        blocks=[w.blocks for w in pieces],
        formats=[w.format + p.act8 for p in quant for _, w in p.weight.pieces()],
        counts=[len(cast(QuantProj, p).weight.pieces()) for p in projs],
        local_rope=[int(ly.local_rope) for ly in layers],
        panel_q=[p.q if p else None for p in panels],
        panel_scales=[p.scales if p else None for p in panels],
        panel_offsets=[p.offsets if p else None for p in panels],
        # one instruction set's kernels run every projection, so one range for all
        panel_rows=next((p.panel_rows for p in quant if p.panels), range(0)))
