"""The Llama forward over a paged KV cache, for a flat batch of tokens from many sequences.

One step's tokens (whole or partial prompts and single decode tokens, concatenated) go
through every layer's projections and MLP as one [T, hidden] matrix, which is where almost
all the flops are. Only attention cares which sequence a token belongs to. Each token's K/V
is first written to its cache slot, and then every row reads its whole context back from the
cache through its block table, so a chunked prefill, a resumed sequence and a decode step
are the same computation. Decode rows (one query each) are batched into one attention
call: their contexts are gathered into a padded [Bd, S] slot grid and masked by length.
Rows with several queries (prefill chunks) are done one by one with a causal mask offset by
what is already cached. Grouped-query attention never repeats the KV heads: the G query
heads that share a KV head are laid out as that head's queries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from nanoserve.model.base import ForwardBatch, ModelConfig
from nanoserve.model.loader import load_model_config


@dataclass(slots=True)
class _Layer:
    attn_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [hidden, (H + 2 KV) * D]: q, k and v projections fused, transposed
    o: torch.Tensor  # [H * D, hidden]
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [hidden, 2 I]: gate and up projections fused, transposed
    down: torch.Tensor  # [I, hidden]


@dataclass(slots=True)
class _Prefill:
    start: int  # first flat token index of the row
    end: int
    blocks: torch.Tensor  # [nb] the row's blocks covering its context, in order
    ctx: int  # context length after this step
    # [q, ctx] bool, True where query i may attend to position j; None for a first chunk
    # (q == ctx), where plain causal attention lets the kernel skip the upper triangle.
    mask: torch.Tensor | None


@dataclass(slots=True)
class _Plan:
    """Everything a step needs besides the weights, built once and shared by all layers."""

    input_ids: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    cos: torch.Tensor  # [T, 1, D]
    sin: torch.Tensor  # [T, 1, D]
    logits_indices: torch.Tensor  # [R]
    decode_tokens: torch.Tensor | None  # [Bd] flat token index of each decode row
    decode_blocks: torch.Tensor | None  # [Bd, W] block tables, padded to the longest row
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, W * block_size] bool
    prefills: list[_Prefill]
    # Gather buffers reused by every layer: fresh ones each layer cost page faults that
    # took longer than the copy itself.
    k_buf: torch.Tensor | None = None  # [Bd * W, bs * KV * D]
    v_buf: torch.Tensor | None = None


def _t(w: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [in, out], contiguous."""
    return w.t().contiguous()


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
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=self.device, dtype=dtype)

        self.embed = w("model.embed_tokens.weight")  # [vocab, hidden]
        self.norm = w("model.norm.weight")
        self.lm_head = (  # [vocab, hidden]
            self.embed if config.tie_word_embeddings else w("lm_head.weight")
        )
        self.layers: list[_Layer] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            # Projections are stored transposed, [in, out] and contiguous: `h @ W` then beats
            # `F.linear(h, W)` by 20-40% at decode batch sizes on this CPU (measured with
            # M = 1 and 32 rows); at prefill sizes the two are the same.
            self.layers.append(_Layer(
                attn_norm=w(p + "input_layernorm.weight"),
                qkv=_t(torch.cat([w(p + f"self_attn.{n}_proj.weight") for n in "qkv"])),
                o=_t(w(p + "self_attn.o_proj.weight")),
                mlp_norm=w(p + "post_attention_layernorm.weight"),
                gate_up=_t(torch.cat([w(p + "mlp.gate_proj.weight"),
                                      w(p + "mlp.up_proj.weight")])),
                down=_t(w(p + "mlp.down_proj.weight")),
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
        cls, folder: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32
    ) -> LlamaModel:
        folder = Path(folder)
        weights: dict[str, torch.Tensor] = {}
        for path in sorted(folder.glob("*.safetensors")):
            weights.update(load_file(str(path)))
        return cls(load_model_config(folder), weights, device=device, dtype=dtype)

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
        decode_rows = [r for r, q in enumerate(b.query_lens) if q == 1]
        decode_tokens = decode_blocks = decode_mask = None
        if decode_rows:
            ctx_lens = [b.context_lens[r] for r in decode_rows]
            width = -(-max(ctx_lens) // bs)  # blocks in the longest decode row
            # Pad with block 0: any real block will do, the mask hides it.
            decode_blocks = tensor([(b.block_tables[r] + [0] * width)[:width] for r in decode_rows])
            j = torch.arange(width * bs, device=dev)  # [W * bs] context position
            decode_mask = (j < tensor(ctx_lens)[:, None])[:, None, None, :]
            decode_tokens = tensor([starts[r] for r in decode_rows])
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
            decode_tokens=decode_tokens,
            decode_blocks=decode_blocks,
            decode_mask=decode_mask,
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
                gate, up = (h @ layer.gate_up).chunk(2, dim=-1)  # [T, I] each
                x = x + (F.silu(gate) * up) @ layer.down
            # Norm and LM head only where logits are wanted: an unfinished prefill chunk
            # needs none, and the head is the largest matrix in a small model.
            h = rms_norm(x[plan.logits_indices], self.norm, eps)  # [R, hidden]
        # The head runs outside inference mode so that the logits are an ordinary tensor: a
        # sampler may then scale or mask them in place (inference tensors forbid that).
        with torch.no_grad():
            return F.linear(h, self.lm_head).float()  # [R, vocab]

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
        q, k, v = (h @ layer.qkv).split([nh * d, nkv * d, nkv * d], dim=-1)
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
        if plan.decode_tokens is not None:
            assert plan.decode_blocks is not None
            assert plan.decode_mask is not None
            # A row's G heads sharing a KV head become that head's G "queries".
            qd = q[plan.decode_tokens].view(-1, nkv, g, d)  # [Bd, KV, G, D]
            bd, w = plan.decode_blocks.shape
            flat = plan.decode_blocks.view(-1)
            if plan.k_buf is None or plan.v_buf is None:
                plan.k_buf = k_blocks.new_empty((bd * w, bs * nkv * d))
                plan.v_buf = v_blocks.new_empty((bd * w, bs * nkv * d))
            torch.index_select(k_blocks, 0, flat, out=plan.k_buf)
            torch.index_select(v_blocks, 0, flat, out=plan.v_buf)
            kd = plan.k_buf.view(bd, w * bs, nkv, d).transpose(1, 2)  # [Bd, KV, S, D]
            vd = plan.v_buf.view(bd, w * bs, nkv, d).transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=plan.decode_mask)
            out[plan.decode_tokens] = od.reshape(-1, nh, d)
        for p in plan.prefills:
            n = p.end - p.start
            qp = q[p.start:p.end].view(n, nkv, g, d).permute(1, 2, 0, 3)  # [KV, G, q, D]
            # [KV, 1, ctx, D] broadcast over the G query heads: a view, not a copy.
            kp = k_blocks.index_select(0, p.blocks).view(-1, nkv, d)[: p.ctx]  # [ctx, KV, D]
            vp = v_blocks.index_select(0, p.blocks).view(-1, nkv, d)[: p.ctx]
            kp = kp.transpose(0, 1)[:, None].expand(nkv, g, -1, d)
            vp = vp.transpose(0, 1)[:, None].expand(nkv, g, -1, d)
            op = F.scaled_dot_product_attention(  # [KV, G, q, D]
                qp, kp, vp, attn_mask=p.mask, is_causal=p.mask is None
            )
            out[p.start:p.end] = op.permute(2, 0, 1, 3).reshape(n, nh, d)
        return out.view(t, nh * d) @ layer.o  # [T, hidden]
