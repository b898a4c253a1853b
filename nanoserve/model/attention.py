"""Attention over the paged KV cache for one step's flat batch of rows.

Each token's K/V is first written to its cache slot, and then every row reads its whole
context back from the cache through its block table, so a chunked prefill, a resumed
sequence and a decode step are the same computation; only a first prefill chunk, whose
context is exactly what this step computed, reads its K/V straight from the step.

Decode rows (one query each) take one of two paths:
- native (float32 on a CPU, when model/native.py could build the kernel): one call per
  layer for all decode rows, reading keys and values in place through the block tables;
- stock PyTorch (any device or dtype): rows of similar length in groups whose context
  blocks are gathered into a padded [g, S] slot grid, masked by length and attended to
  with SDPA while the copy is still in cache.
Rows with several queries (prefill chunks) go one by one through SDPA with a causal mask
offset by what is already cached. Grouped-query attention never repeats the KV heads: the
G query heads that share a KV head are laid out as that head's queries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanoserve.model.base import ForwardBatch
from nanoserve.model.native import Kernels

# Head sizes the native kernel is compiled for (model/csrc/attention.cpp).
NATIVE_HEAD_DIMS = (16, 32, 64, 128)

# Stock path: decode rows gather their context in groups of about this many bytes of K (and
# as many of V), each group's attention computed right after its gather, while the copy is
# still in cache: gathering the whole batch first wrote 15 MB per layer at 32 rows of 300
# tokens and read it back from memory. A group is also padded only to its own longest row.
DECODE_GROUP_BYTES = 1 << 20


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
class _DecodeGroup:
    tokens: torch.Tensor  # [g] flat token index of each row
    blocks: torch.Tensor  # [g * W] the rows' block tables, padded to the group's longest row
    mask: torch.Tensor  # [g, 1, 1, W * block_size] bool, True at a row's context positions
    width: int  # W


@dataclass(slots=True)
class _NativeDecode:
    rows: torch.Tensor  # [R] flat token index of each decode row
    block_tables: torch.Tensor  # [R, W] padded with block 0 past each row's context
    context_lens: torch.Tensor  # [R]


@dataclass(slots=True)
class AttentionPlan:
    """Everything attention needs besides q, k, v: built once a step, shared by all layers."""

    block_size: int
    native: _NativeDecode | None
    groups: list[_DecodeGroup]
    prefills: list[_Prefill]
    # what q.k is multiplied by before the softmax (Gemma's query_pre_attn_scalar ** -0.5);
    # None: head_dim ** -0.5, what SDPA does unasked (and bitwise the same when asked)
    scale: float | None = None
    # Gather buffers reused by every group and layer: fresh ones each layer cost page faults
    # that took longer than the copy itself.
    k_buf: torch.Tensor | None = None  # [max group g * W, bs * KV * D]
    v_buf: torch.Tensor | None = None


def plan_attention(
    b: ForwardBatch, *, block_size: int, kv_row_bytes: int, group_bytes: int, native: bool,
    device: torch.device, scale: float | None = None,
) -> AttentionPlan:
    """kv_row_bytes: K bytes of one block (bs * KV * D * element size), for the grouping."""
    bs = block_size

    def tensor(values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    starts = [0]
    for q in b.query_lens:
        starts.append(starts[-1] + q)
    decode_rows = [r for r, q in enumerate(b.query_lens) if q == 1]
    plan = AttentionPlan(bs, None, [], [], scale=scale)
    if native and decode_rows:
        width = max(-(-b.context_lens[r] // bs) for r in decode_rows)
        plan.native = _NativeDecode(
            tensor([starts[r] for r in decode_rows]),
            tensor([(b.block_tables[r] + [0] * width)[:width] for r in decode_rows]),
            tensor([b.context_lens[r] for r in decode_rows]))
    elif decode_rows:
        plan.groups = _decode_groups(b, decode_rows, starts, bs, kv_row_bytes, group_bytes,
                                     tensor)
    for r, q in enumerate(b.query_lens):
        if q <= 1:
            continue
        ctx = b.context_lens[r]
        j = torch.arange(ctx, device=device)
        blocks = tensor(b.block_tables[r][: -(-ctx // bs)])
        # Query i sits at position ctx - q + i and sees positions 0 ..= that.
        mask = None if q == ctx else j <= torch.arange(ctx - q, ctx, device=device)[:, None]
        plan.prefills.append(_Prefill(starts[r], starts[r + 1], blocks, ctx, mask))
    return plan


def _decode_groups(
    b: ForwardBatch, decode_rows: list[int], starts: list[int], bs: int, row_bytes: int,
    group_bytes: int, tensor: Callable[[list[int] | list[list[int]]], torch.Tensor],
) -> list[_DecodeGroup]:
    # Shortest context first, so that a group's rows pad to similar widths.
    decode_rows = sorted(decode_rows, key=lambda r: b.context_lens[r])
    groups: list[_DecodeGroup] = []
    i = 0
    while i < len(decode_rows):
        # As many rows as fit the byte budget at the width of the group's longest row.
        n = 1
        while i + n < len(decode_rows):
            w = -(-b.context_lens[decode_rows[i + n]] // bs)
            if (n + 1) * w * row_bytes > group_bytes:
                break
            n += 1
        rows = decode_rows[i : i + n]
        i += n
        ctx_lens = [b.context_lens[r] for r in rows]
        width = -(-ctx_lens[-1] // bs)  # blocks in the group's longest row
        # Pad with block 0: any real block will do, the mask hides it.
        blocks = tensor([(b.block_tables[r] + [0] * width)[:width] for r in rows])
        j = torch.arange(width * bs, device=blocks.device)  # [W * bs] context position
        in_ctx = (j < tensor(ctx_lens)[:, None])[:, None, None, :]
        groups.append(_DecodeGroup(tensor([starts[r] for r in rows]), blocks.view(-1), in_ctx,
                                   width))
    return groups


def attend(
    q: torch.Tensor,  # [T, H, D], RoPE applied
    k: torch.Tensor,  # [T, KV, D], RoPE applied, already written to the cache
    v: torch.Tensor,  # [T, KV, D]
    k_cache: torch.Tensor,  # [slots, KV, D]
    v_cache: torch.Tensor,  # [slots, KV, D]
    plan: AttentionPlan,
    kernels: Kernels | None = None,  # native decode attention's; needed when plan.native
) -> torch.Tensor:  # [T, H, D]
    t, nh, d = q.shape
    nkv = k.shape[1]
    g = nh // nkv  # query heads per KV head; head h reads KV head h // g
    bs = plan.block_size
    scale = d**-0.5 if plan.scale is None else plan.scale
    out = torch.empty_like(q)
    if plan.native is not None:
        n = plan.native
        assert kernels is not None, "a plan with native decode rows needs the kernels"
        kernels.ops.paged_decode_attention(
            q, k_cache, v_cache, n.rows, n.block_tables, n.context_lens, bs, scale, out)
    # The cache seen as whole blocks: gathering a block is one contiguous copy of
    # bs * KV * D values, where gathering slot by slot copied 768-byte rows one at a time.
    k_blocks = k_cache.view(-1, bs * nkv * d)  # [num_blocks, bs * KV * D]
    v_blocks = v_cache.view(-1, bs * nkv * d)
    if plan.groups and (plan.k_buf is None or plan.v_buf is None):
        most = max(grp.blocks.shape[0] for grp in plan.groups)
        plan.k_buf = k_blocks.new_empty((most, bs * nkv * d))
        plan.v_buf = v_blocks.new_empty((most, bs * nkv * d))
    for grp in plan.groups:
        assert plan.k_buf is not None
        assert plan.v_buf is not None
        # A row's G heads sharing a KV head become that head's G "queries".
        qd = q[grp.tokens].view(-1, nkv, g, d)  # [g, KV, G, D]
        n_blocks = grp.blocks.shape[0]
        kb = torch.index_select(k_blocks, 0, grp.blocks, out=plan.k_buf[:n_blocks])
        vb = torch.index_select(v_blocks, 0, grp.blocks, out=plan.v_buf[:n_blocks])
        kd = kb.view(-1, grp.width * bs, nkv, d).transpose(1, 2)  # [g, KV, S, D]
        vd = vb.view(-1, grp.width * bs, nkv, d).transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=grp.mask, scale=scale)
        out[grp.tokens] = od.reshape(-1, nh, d)
    for p in plan.prefills:
        rows = p.end - p.start
        qp = q[p.start:p.end].view(rows, nkv, g, d).permute(1, 2, 0, 3)  # [KV, G, q, D]
        if p.mask is None:  # a first chunk: its context is just what this step computed
            kp, vp = k[p.start:p.end], v[p.start:p.end]  # [ctx, KV, D]
        else:
            kp = k_blocks.index_select(0, p.blocks).view(-1, nkv, d)[: p.ctx]
            vp = v_blocks.index_select(0, p.blocks).view(-1, nkv, d)[: p.ctx]
        # [KV, 1, ctx, D] broadcast over the G query heads: a view, not a copy.
        kp = kp.transpose(0, 1)[:, None].expand(nkv, g, -1, d)
        vp = vp.transpose(0, 1)[:, None].expand(nkv, g, -1, d)
        op = F.scaled_dot_product_attention(  # [KV, G, q, D]
            qp, kp, vp, attn_mask=p.mask, is_causal=p.mask is None, scale=scale
        )
        out[p.start:p.end] = op.permute(2, 0, 1, 3).reshape(rows, nh, d)
    return out
