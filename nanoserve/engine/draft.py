"""Draft-model proposals: a small model that shares the target's tokenizer proposes k tokens
for a sequence by greedy decoding, and the target checks them in its step's one forward as
it checks an n-gram's (speculative.py). A greedy pick is a function of the context, so the
check keeps the target's tokens, token for token, at any temperature.

The draft keeps a paged KV cache of its own (its own blocks, its own pool), one entry per
sequence: the tokens whose K/V it holds. Each proposal first computes what the sequence
gained since the last one (the prompt, at first; then the tokens the target kept), in one
forward, whose last row gives the first proposed token; each further token is one more
forward of one row. Where the target refused part of the last proposal, the draft's cache
past the kept tokens is simply overwritten: a sequence's entry is cut back to its longest
prefix that is still the sequence's. A sequence only grows, so that is only a question for
the proposal's tokens: everything before them was the sequence's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from nanoserve.engine.kv import BlockPool
from nanoserve.model.base import ForwardBatch, Model


@dataclass
class _Cached:
    """A sequence in the draft's cache: the tokens whose K/V it holds, in order, the
    blocks they (and the next proposal) live in, and how many of them were the sequence's
    own when it last proposed (the rest were proposed tokens, kept or not)."""

    ids: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    own: int = 0


class DraftProposer:
    """Greedy proposals from `model` (loaded by the caller, its KV cache set up here).
    `vocab_size`: the target's; a draft token at or past it (a padded vocabulary) ends the
    proposal there."""

    def __init__(self, model: Model, num_blocks: int, block_size: int, vocab_size: int) -> None:
        self.model = model
        model.init_kv_cache(num_blocks, block_size)
        self.pool = BlockPool(num_blocks, block_size, prefix_caching=False)
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.seqs: dict[str, _Cached] = {}

    def propose(self, seq_id: str, tokens: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens the draft picks greedily after `tokens`; fewer where its pool
        has no room for them (then none) or it picks a token the target lacks."""
        if k < 1 or not tokens:
            return []
        c = self.seqs.setdefault(seq_id, _Cached())
        keep = c.own  # then as many of the proposed tokens as the sequence kept
        while keep < min(len(c.ids), len(tokens)) and c.ids[keep] == tokens[keep]:
            keep += 1
        keep = min(keep, len(tokens) - 1)  # at least one token in: its row gives the first
        del c.ids[keep:]
        c.own = keep
        if not self._room(c, len(tokens) + k - 1):
            return []
        out: list[int] = []
        new = list(tokens[keep:])
        while True:
            start = len(c.ids)
            c.ids += new
            logits = self.model.forward(self._batch(c, start, new))
            if not out:  # every token of the sequence is in now
                c.own = len(c.ids)
            token = int(logits[0].argmax())
            if token >= self.vocab_size:
                break
            out.append(token)
            if len(out) == k:
                break
            new = [token]
        return out

    def drop(self, seq_id: str) -> None:
        """The sequence is done: its blocks go back to the draft's pool."""
        c = self.seqs.pop(seq_id, None)
        if c is not None:
            self.pool.release(c.blocks)

    def _room(self, c: _Cached, positions: int) -> bool:
        """Blocks for `positions` tokens of `c`, allocated where it lacks them."""
        need = -(-positions // self.block_size) - len(c.blocks)
        if need <= 0:
            return True
        if not self.pool.can_allocate(need):
            return False
        c.blocks += self.pool.allocate(need)
        return True

    def _batch(self, c: _Cached, start: int, new: list[int]) -> ForwardBatch:
        """One row: `new` at positions start.. of `c`, the logits of its last token."""
        bs = self.block_size
        end = start + len(new)
        return ForwardBatch(
            input_ids=new, positions=list(range(start, end)),
            slot_mapping=[c.blocks[p // bs] * bs + p % bs for p in range(start, end)],
            query_lens=[len(new)], context_lens=[end],
            block_tables=[c.blocks[: -(-end // bs)]], logits_indices=[len(new) - 1],
            histories=[c.ids], seeds=[0])

