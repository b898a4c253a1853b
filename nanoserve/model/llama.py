"""The Llama forward over a paged KV cache, for a flat batch of tokens from many sequences.

One step's tokens (whole or partial prompts and single decode tokens, concatenated) go
through every layer's projections and MLP as one [T, hidden] matrix, which is where almost
all the flops are (model/linear.py: pre-packed weights). Only attention cares which sequence
a token belongs to. Each token's K/V is first written to its cache slot, and then every row
reads its whole context back from the cache through its block table, so a chunked prefill,
a resumed sequence and a decode step are the same computation; only a first prefill chunk,
whose context is exactly what this step computed, reads its K/V straight from the step.
Decode rows (one query each) are batched into attention calls by groups of rows of similar
length: each group's context blocks are gathered into a padded [g, S] slot grid, masked by
length, and attended to while the copy is still in cache. Rows with several queries
(prefill chunks) are done one by one with a causal mask offset by what is already cached.
Grouped-query attention never repeats the KV heads: the G query heads that share a KV head
are laid out as that head's queries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from nanoserve.model.base import ForwardBatch, ModelConfig
from nanoserve.model.linear import Proj, mkl_packing_available
from nanoserve.model.loader import load_model_config


@dataclass(slots=True)
class _Layer:
    attn_norm: torch.Tensor  # [hidden]
    qkv: Proj  # hidden -> (H + 2 KV) * D: q, k and v projections fused
    o: Proj  # H * D -> hidden
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: Proj  # hidden -> 2 I: gate and up projections fused
    down: Proj  # I -> hidden


@dataclass(slots=True)
class _Prefill:
    start: int  # first flat token index of the row
    end: int
    blocks: torch.Tensor  # [nb] the row's blocks covering its context, in order
    ctx: int  # context length after this step
    # [q, ctx] bool, True where query i may attend to position j; None for a first chunk
    # (q == ctx), where plain causal attention lets the kernel skip the upper triangle.
    mask: torch.Tensor | None


# Decode rows gather their context in groups of about this many bytes of K (and as many of
# V), each group's attention computed right after its gather, while the copy is still in
# cache: gathering the whole batch first wrote 15 MB per layer at 32 rows of 300 tokens and
# read it back from memory. A group is also padded only to its own longest row.
_DECODE_GROUP_BYTES = 1 << 20


@dataclass(slots=True)
class _DecodeGroup:
    tokens: torch.Tensor  # [g] flat token index of each row
    blocks: torch.Tensor  # [g * W] the rows' block tables, padded to the group's longest row
    mask: torch.Tensor  # [g, 1, 1, W * block_size] bool, True at a row's context positions
    width: int  # W


@dataclass(slots=True)
class _Plan:
    """Everything a step needs besides the weights, built once and shared by all layers."""

    input_ids: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    cos: torch.Tensor  # [T, 1, D]
    sin: torch.Tensor  # [T, 1, D]
    logits_indices: torch.Tensor  # [R]
    decode: list[_DecodeGroup]
    prefills: list[_Prefill]
    # Gather buffers reused by every group and layer: fresh ones each layer cost page faults
    # that took longer than the copy itself.
    k_buf: torch.Tensor | None = None  # [max group g * W, bs * KV * D]
    v_buf: torch.Tensor | None = None


def load_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        weights.update(load_file(str(path)))
    return weights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # In float32 whatever the model dtype, then back, as the reference does: the mean of
    # squares of 576 bf16 values loses too much otherwise.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    # Pairs dimension i with i + D/2 (the Hugging Face layout the loader converts to).
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        pack_weights: bool | None = None,
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        if pack_weights is None:  # wherever it is possible
            pack_weights = (self.device.type == "cpu" and dtype == torch.float32
                            and mkl_packing_available())
        self.pack_weights = pack_weights
        self.decode_group_bytes = _DECODE_GROUP_BYTES

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=self.device, dtype=dtype)

        self.embed = w("model.embed_tokens.weight")  # [vocab, hidden]
        self.norm = w("model.norm.weight")
        head = self.embed if config.tie_word_embeddings else w("lm_head.weight")
        self.lm_head = Proj(head, pack=pack_weights)  # hidden -> vocab
        self.layers: list[_Layer] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."

            def proj(*names: str, p: str = p) -> Proj:  # several: fused along the output
                return Proj(torch.cat([w(p + n + ".weight") for n in names]), pack=pack_weights)

            self.layers.append(_Layer(
                attn_norm=w(p + "input_layernorm.weight"),
                qkv=proj("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                o=proj("self_attn.o_proj"),
                mlp_norm=w(p + "post_attention_layernorm.weight"),
                gate_up=proj("mlp.gate_proj", "mlp.up_proj"),
                down=proj("mlp.down_proj"),
            ))
        # RoPE angles for every position, once: pos * theta^(-2i/D) in float32 (the product
        # is exact to one rounding, as in the reference), duplicated for rotate_half.
        d = config.head_dim
        inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, d, 2).float() / d)  # [D/2]
        pos = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        angles = torch.outer(pos, inv_freq)
        angles = torch.cat((angles, angles), dim=-1)  # [P, D]
        self._cos = angles.cos().to(self.device, dtype)
        self._sin = angles.sin().to(self.device, dtype)
        self.kv_cache: torch.Tensor | None = None  # [L, 2, num_blocks * block_size, KV, D]
        self.block_size = 0

    @classmethod
    def from_folder(
        cls, folder: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32,
        pack_weights: bool | None = None,
    ) -> LlamaModel:
        return cls(load_model_config(Path(folder)), load_weights(folder), device=device,
                   dtype=dtype, pack_weights=pack_weights)

    # ---- KV cache -------------------------------------------------------------------------

    def kv_bytes_per_block(self, block_size: int) -> int:
        c = self.config
        elem = torch.empty((), dtype=self.dtype).element_size()
        return c.num_layers * 2 * block_size * c.num_kv_heads * c.head_dim * elem

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        c = self.config
        self.block_size = block_size
        self.kv_cache = torch.zeros(
            (c.num_layers, 2, num_blocks * block_size, c.num_kv_heads, c.head_dim),
            device=self.device, dtype=self.dtype,
        )

    @torch.inference_mode()
    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        if not pairs:
            return
        cache = self._cache()
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        blocks = cache.view(*cache.shape[:2], -1, self.block_size, *cache.shape[3:])
        # The right side is gathered before any write, so chains like (1->2, 2->3) copy the
        # old block 2, as if all pairs were copied at once.
        blocks[:, :, dst] = blocks[:, :, src]

    def _cache(self) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError("init_kv_cache() must be called before forward()")
        return self.kv_cache

    # ---- forward --------------------------------------------------------------------------

    def _plan(self, b: ForwardBatch) -> _Plan:
        """Turn the batch's lists into index tensors: one host-to-device copy each, no syncs."""
        if len(b.input_ids) != sum(b.query_lens) or len(b.query_lens) != len(b.block_tables):
            raise ValueError("ForwardBatch: input_ids, query_lens and block_tables disagree")
        dev, bs = self.device, self.block_size

        def tensor(values: list[int] | list[list[int]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=dev)

        positions = tensor(b.positions)
        starts = [0]
        for q in b.query_lens:
            starts.append(starts[-1] + q)
        # Decode rows, shortest context first, so that a group's rows pad to similar widths.
        decode_rows = sorted((r for r, q in enumerate(b.query_lens) if q == 1),
                             key=lambda r: b.context_lens[r])
        c = self.config
        row_bytes = bs * c.num_kv_heads * c.head_dim * self._cache().element_size()
        decode: list[_DecodeGroup] = []
        i = 0
        while i < len(decode_rows):
            # As many rows as fit the byte budget at the width of the group's longest row.
            n = 1
            while i + n < len(decode_rows):
                w = -(-b.context_lens[decode_rows[i + n]] // bs)
                if (n + 1) * w * row_bytes > self.decode_group_bytes:
                    break
                n += 1
            rows = decode_rows[i : i + n]
            i += n
            ctx_lens = [b.context_lens[r] for r in rows]
            width = -(-ctx_lens[-1] // bs)  # blocks in the group's longest row
            # Pad with block 0: any real block will do, the mask hides it.
            blocks = tensor([(b.block_tables[r] + [0] * width)[:width] for r in rows])
            j = torch.arange(width * bs, device=dev)  # [W * bs] context position
            in_ctx = (j < tensor(ctx_lens)[:, None])[:, None, None, :]
            decode.append(_DecodeGroup(tensor([starts[r] for r in rows]), blocks.view(-1),
                                       in_ctx, width))
        prefills = []
        for r, q in enumerate(b.query_lens):
            if q <= 1:
                continue
            ctx = b.context_lens[r]
            j = torch.arange(ctx, device=dev)
            blocks = tensor(b.block_tables[r][: -(-ctx // bs)])
            # Query i sits at position ctx - q + i and sees positions 0 ..= that.
            mask = None if q == ctx else j <= torch.arange(ctx - q, ctx, device=dev)[:, None]
            prefills.append(_Prefill(starts[r], starts[r + 1], blocks, ctx, mask))
        return _Plan(
            input_ids=tensor(b.input_ids),
            slot_mapping=tensor(b.slot_mapping),
            cos=self._cos[positions][:, None, :],
            sin=self._sin[positions][:, None, :],
            logits_indices=tensor(b.logits_indices),
            decode=decode,
            prefills=prefills,
        )

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        cache = self._cache()
        with torch.inference_mode():
            plan = self._plan(batch)
            eps = self.config.rms_norm_eps
            x = F.embedding(plan.input_ids, self.embed)  # [T, hidden]
            for i, layer in enumerate(self.layers):
                h = rms_norm(x, layer.attn_norm, eps)
                x = x + self._attention(layer, h, cache[i, 0], cache[i, 1], plan)
                h = rms_norm(x, layer.mlp_norm, eps)
                gate, up = layer.gate_up(h).chunk(2, dim=-1)  # [T, I] each
                x = x + layer.down(F.silu(gate) * up)
            # Norm and LM head only where logits are wanted: an unfinished prefill chunk
            # needs none, and the head is the largest matrix in a small model.
            h = rms_norm(x[plan.logits_indices], self.norm, eps)  # [R, hidden]
        # The head runs outside inference mode so that the logits are an ordinary tensor: a
        # sampler may then scale or mask them in place (inference tensors forbid that).
        with torch.no_grad():
            return self.lm_head(h).float()  # [R, vocab]

    def _attention(
        self,
        layer: _Layer,
        h: torch.Tensor,  # [T, hidden]
        k_cache: torch.Tensor,  # [slots, KV, D]
        v_cache: torch.Tensor,  # [slots, KV, D]
        plan: _Plan,
    ) -> torch.Tensor:
        c = self.config
        nh, nkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        g = nh // nkv  # query heads per KV head; head h reads KV head h // g
        t = h.shape[0]
        q, k, v = layer.qkv(h).split([nh * d, nkv * d, nkv * d], dim=-1)
        q = q.view(t, nh, d)
        k = k.view(t, nkv, d)
        q = q * plan.cos + rotate_half(q) * plan.sin  # [T, H, D]
        k = k * plan.cos + rotate_half(k) * plan.sin  # [T, KV, D]
        k_cache.index_copy_(0, plan.slot_mapping, k)
        v_cache.index_copy_(0, plan.slot_mapping, v.view(t, nkv, d))

        out = torch.empty_like(q)  # [T, H, D]
        bs = self.block_size
        # The cache seen as whole blocks: gathering a block is one contiguous copy of
        # bs * KV * D values, where gathering slot by slot copied 768-byte rows one at a
        # time (that gather was half of a decode step).
        k_blocks = k_cache.view(-1, bs * nkv * d)  # [num_blocks, bs * KV * D]
        v_blocks = v_cache.view(-1, bs * nkv * d)
        if plan.decode and (plan.k_buf is None or plan.v_buf is None):
            most = max(grp.blocks.shape[0] for grp in plan.decode)
            plan.k_buf = k_blocks.new_empty((most, bs * nkv * d))
            plan.v_buf = v_blocks.new_empty((most, bs * nkv * d))
        for grp in plan.decode:
            assert plan.k_buf is not None
            assert plan.v_buf is not None
            # A row's G heads sharing a KV head become that head's G "queries".
            qd = q[grp.tokens].view(-1, nkv, g, d)  # [g, KV, G, D]
            n = grp.blocks.shape[0]
            kb = torch.index_select(k_blocks, 0, grp.blocks, out=plan.k_buf[:n])
            vb = torch.index_select(v_blocks, 0, grp.blocks, out=plan.v_buf[:n])
            kd = kb.view(-1, grp.width * bs, nkv, d).transpose(1, 2)  # [g, KV, S, D]
            vd = vb.view(-1, grp.width * bs, nkv, d).transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=grp.mask)
            out[grp.tokens] = od.reshape(-1, nh, d)
        for p in plan.prefills:
            n = p.end - p.start
            qp = q[p.start:p.end].view(n, nkv, g, d).permute(1, 2, 0, 3)  # [KV, G, q, D]
            if p.mask is None:  # a first chunk: its context is just what this step computed
                kp, vp = k[p.start:p.end], v.view(t, nkv, d)[p.start:p.end]  # [ctx, KV, D]
            else:
                kp = k_blocks.index_select(0, p.blocks).view(-1, nkv, d)[: p.ctx]
                vp = v_blocks.index_select(0, p.blocks).view(-1, nkv, d)[: p.ctx]
            # [KV, 1, ctx, D] broadcast over the G query heads: a view, not a copy.
            kp = kp.transpose(0, 1)[:, None].expand(nkv, g, -1, d)
            vp = vp.transpose(0, 1)[:, None].expand(nkv, g, -1, d)
            op = F.scaled_dot_product_attention(  # [KV, G, q, D]
                qp, kp, vp, attn_mask=p.mask, is_causal=p.mask is None
            )
            out[p.start:p.end] = op.permute(2, 0, 1, 3).reshape(n, nh, d)
        return layer.o(out.view(t, nh * d))  # [T, hidden]
