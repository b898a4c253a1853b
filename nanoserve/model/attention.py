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

Sliding windows (model/architectures.py says which layers have one): query position p sees
key j iff j <= p and p - j < window. `windowed` derives the windowed layers' plan from the
full one, once a step, sharing its block tables and buffers: the native kernel takes the
window as an argument, the stock decode groups and the prefills get banded masks (a first
chunk longer than the window too: is_causal alone no longer says it), and a continuation
chunk reads only the keys its window reaches. Where no row's context exceeds the window,
the windowed plan is the full one itself. Every block stays allocated (see
architectures._sliding_window), so the prefix cache and preemption need nothing here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from nanoserve.model.base import ForwardBatch
from nanoserve.model.native import Kernels

# Head sizes the native kernel is compiled for (model/csrc/attention.cpp).
NATIVE_HEAD_DIMS = (16, 32, 64, 128, 256)

# Stock path: decode rows gather their context in groups of about this many bytes of K (and
# as many of V), each group's attention computed right after its gather, while the copy is
# still in cache: gathering the whole batch first wrote 15 MB per layer at 32 rows of 300
# tokens and read it back from memory. A group is also padded only to its own longest row.
DECODE_GROUP_BYTES = 1 << 20


@dataclass(slots=True)
class _Prefill:
    start: int  # first flat token index of the row
    end: int
    blocks: torch.Tensor  # [nb] the row's blocks covering keys lo .. ctx - 1, in order
    ctx: int  # context length after this step
    # [q, ctx - lo] bool, True where query i may attend to position lo + j; None for a first
    # chunk (q == ctx) without a binding window, where plain causal attention lets the kernel
    # skip the upper triangle.
    mask: torch.Tensor | None
    first: bool  # q == ctx: its K/V are this step's, read straight from it
    lo: int = 0  # the first key position any query reaches (> 0 only under a window)


@dataclass(slots=True)
class _DecodeGroup:
    tokens: torch.Tensor  # [g] flat token index of each row
    blocks: torch.Tensor  # [g * W] the rows' block tables, padded to the group's longest row
    # [g, 1, 1, W * block_size] bool, True at a row's context positions (in its window, in a
    # windowed plan)
    mask: torch.Tensor
    width: int  # W
    ctx_lens: list[int]  # [g]


@dataclass(slots=True)
class _NativeDecode:
    rows: torch.Tensor  # [R] flat token index of each decode row
    block_tables: torch.Tensor  # [R, W] padded with block 0 past each row's context
    context_lens: torch.Tensor  # [R]
    window: int = 0  # 0, or each row attends to its last `window` positions only


@dataclass(slots=True)
class _GatherBuffers:
    # Reused by every group and layer, and by the full and windowed plans alike: fresh ones
    # each layer cost page faults that took longer than the copy itself.
    k: torch.Tensor | None = None  # [max group g * W, bs * KV * D]
    v: torch.Tensor | None = None


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
    bufs: _GatherBuffers = field(default_factory=_GatherBuffers)


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
        blocks = tensor(b.block_tables[r][: -(-ctx // bs)])
        plan.prefills.append(_Prefill(starts[r], starts[r + 1], blocks, ctx,
                                      _prefill_mask(ctx, q, 0, None, device), q == ctx))
    return plan


def _prefill_mask(ctx: int, q: int, lo: int, window: int | None, device: torch.device
                  ) -> torch.Tensor | None:
    """[q, ctx - lo]: query i, at position ctx - q + i, sees key positions lo + j up to its
    own, and under a window only the last `window` of them; None where plain causal
    attention says it (a first chunk that no window binds)."""
    if q == ctx and (window is None or ctx <= window):
        return None
    i = torch.arange(ctx - q, ctx, device=device)[:, None]
    j = torch.arange(lo, ctx, device=device)
    mask = j <= i
    if window is not None:
        mask &= j > i - window
    return mask


def windowed(plan: AttentionPlan, b: ForwardBatch, window: int | None) -> AttentionPlan:
    """The plan for layers with a sliding window: `plan` itself where no row's context
    exceeds the window (it cannot bind), else a copy that differs only in the window's
    masks, the native kernel's argument, and which keys a continuation chunk reads."""
    if window is None or max(b.context_lens, default=0) <= window:
        return plan
    native = None if plan.native is None else replace(plan.native, window=window)
    groups = [grp if max(grp.ctx_lens) <= window else _band_group(grp, window, plan.block_size)
              for grp in plan.groups]
    prefills = []
    for p in plan.prefills:
        if p.ctx <= window:
            prefills.append(p)
            continue
        q, bs = p.end - p.start, plan.block_size
        # The earliest query, at ctx - q, reaches back to ctx - q - window + 1: no block before
        # that one is read (a first chunk's keys are the step's own, all of them needed).
        lo = 0 if p.first else max(0, p.ctx - q - window + 1) // bs * bs
        mask = _prefill_mask(p.ctx, q, lo, window, p.blocks.device)
        prefills.append(replace(p, blocks=p.blocks[lo // bs:], mask=mask, lo=lo))
    return replace(plan, native=native, groups=groups, prefills=prefills)


def _band_group(grp: _DecodeGroup, window: int, bs: int) -> _DecodeGroup:
    """A decode group's mask narrowed to each row's last `window` positions."""
    j = torch.arange(grp.width * bs, device=grp.mask.device)
    lows = torch.tensor([c - window for c in grp.ctx_lens], device=grp.mask.device)
    return replace(grp, mask=grp.mask & (j >= lows[:, None])[:, None, None, :])


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
                                   width, ctx_lens))
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
            q, k_cache, v_cache, n.rows, n.block_tables, n.context_lens, bs, scale, out,
            n.window)
    # The cache seen as whole blocks: gathering a block is one contiguous copy of
    # bs * KV * D values, where gathering slot by slot copied 768-byte rows one at a time.
    k_blocks = k_cache.view(-1, bs * nkv * d)  # [num_blocks, bs * KV * D]
    v_blocks = v_cache.view(-1, bs * nkv * d)
    bufs = plan.bufs
    if plan.groups and (bufs.k is None or bufs.v is None):
        most = max(grp.blocks.shape[0] for grp in plan.groups)
        bufs.k = k_blocks.new_empty((most, bs * nkv * d))
        bufs.v = v_blocks.new_empty((most, bs * nkv * d))
    for grp in plan.groups:
        assert bufs.k is not None
        assert bufs.v is not None
        # A row's G heads sharing a KV head become that head's G "queries".
        qd = q[grp.tokens].view(-1, nkv, g, d)  # [g, KV, G, D]
        n_blocks = grp.blocks.shape[0]
        kb = torch.index_select(k_blocks, 0, grp.blocks, out=bufs.k[:n_blocks])
        vb = torch.index_select(v_blocks, 0, grp.blocks, out=bufs.v[:n_blocks])
        kd = kb.view(-1, grp.width * bs, nkv, d).transpose(1, 2)  # [g, KV, S, D]
        vd = vb.view(-1, grp.width * bs, nkv, d).transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=grp.mask, scale=scale)
        out[grp.tokens] = od.reshape(-1, nh, d)
    for p in plan.prefills:
        rows = p.end - p.start
        qp = q[p.start:p.end].view(rows, nkv, g, d).permute(1, 2, 0, 3)  # [KV, G, q, D]
        if p.first:  # a first chunk: its context is just what this step computed
            kp, vp = k[p.start:p.end], v[p.start:p.end]  # [ctx, KV, D]
        else:  # keys lo .. ctx - 1, from blocks that start at lo (a multiple of bs)
            kp = k_blocks.index_select(0, p.blocks).view(-1, nkv, d)[: p.ctx - p.lo]
            vp = v_blocks.index_select(0, p.blocks).view(-1, nkv, d)[: p.ctx - p.lo]
        # [KV, 1, ctx, D] broadcast over the G query heads: a view, not a copy.
        kp = kp.transpose(0, 1)[:, None].expand(nkv, g, -1, d)
        vp = vp.transpose(0, 1)[:, None].expand(nkv, g, -1, d)
        op = F.scaled_dot_product_attention(  # [KV, G, q, D]
            qp, kp, vp, attn_mask=p.mask, is_causal=p.mask is None, scale=scale
        )
        out[p.start:p.end] = op.permute(2, 0, 1, 3).reshape(rows, nh, d)
    return out
