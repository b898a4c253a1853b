"""The KV block pool: which cache blocks are free, who holds the others, and what they hold.

Pure Python, no torch: the pool only hands out block ids; the model owns the tensors.

Prefix caching lives here. Each *full* block is named by a hash chained from the previous
block's hash and its own token ids, so the block that holds tokens 32..47 of a prompt is the
same name only when tokens 0..47 are the same: a prefix hit is one dict look-up per block.
A freed block keeps its hash and its contents until the pool needs it for something else,
so a prompt that begins like an earlier, finished one still hits (every chat request begins
with the same system prompt). Free blocks are handed out from the front of the free list; a
freed block that carries a name goes to its back and one that does not to its front, so
blocks holding nothing reusable go first and then the least recently freed cached block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nanoserve.engine.request import Request


@dataclass(frozen=True, slots=True)
class PoolStats:
    num_blocks: int
    free: int  # blocks with no holder (some may still hold a cached prefix)
    used: int
    peak_used: int
    cached: int  # blocks that carry a prefix hash (held or free)
    prefix_queries: int  # full prompt blocks looked up
    prefix_hits: int  # of those, found in the cache


def chain_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """Name of a full block: its parent's name plus its own tokens.

    Python's hash of a tuple of ints is the same in every process (only str and bytes
    hashing is salted), so names are stable across runs and replays.
    """
    return hash((parent, tuple(tokens)))


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._by_hash: dict[int, int] = {}
        # Free blocks in eviction order: the front is handed out (and evicted) first.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._peak_used = 0
        self._queries = 0
        self._hits = 0

    # -- queries -------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def block_hash(self, block: int) -> int | None:
        return self._hash[block]

    def free_list(self) -> list[int]:
        """Free block ids in the order they will be handed out."""
        return list(self._free)

    def statistics(self) -> PoolStats:
        used = self.num_blocks - len(self._free)
        return PoolStats(
            num_blocks=self.num_blocks,
            free=len(self._free),
            used=used,
            peak_used=self._peak_used,
            cached=len(self._by_hash),
            prefix_queries=self._queries,
            prefix_hits=self._hits,
        )

    # -- prefix cache ----------------------------------------------------------------------

    def lookup_prefix(self, token_ids: Sequence[int], max_blocks: int,
                      names: list[int] | None = None) -> list[int]:
        """Blocks already holding the longest cached prefix of `token_ids` (full blocks only,
        at most `max_blocks`). Does not take a reference: `acquire` the result to keep it.
        `names`: the names of token_ids' first blocks known so far, extended with those
        this look-up computes (Request.chain)."""
        if not self.prefix_caching:
            return []
        bs = self.block_size
        found: list[int] = []
        parent: int | None = None
        for i in range(min(max_blocks, len(token_ids) // bs)):
            if names is not None and i < len(names):
                h = names[i]
            else:
                h = chain_hash(parent, token_ids[i * bs : (i + 1) * bs])
                if names is not None:
                    names.append(h)
            self._queries += 1
            block = self._by_hash.get(h)
            if block is None:
                break
            self._hits += 1
            found.append(block)
            parent = h
        return found

    def register_full_block(self, block: int, parent: int | None, tokens: Sequence[int],
                            name: int | None = None) -> int:
        """Name a block that has just become full; returns its hash for the next block's chain
        (`name` when the caller knows it already: chain_hash(parent, tokens)).

        If another block already carries this name (two requests computed the same prefix at
        the same time), the first one keeps it: a name maps to exactly one block.
        """
        h = chain_hash(parent, tokens) if name is None else name
        if self.prefix_caching and self._hash[block] is None and h not in self._by_hash:
            self._hash[block] = h
            self._by_hash[h] = block
        return h

    # -- allocation --------------------------------------------------------------------------

    def can_allocate(self, n: int, reusing: Sequence[int] = ()) -> bool:
        """Whether `n` new blocks fit after taking references on the cached blocks `reusing`
        (those that sit in the free list stop being free once taken)."""
        idle = sum(1 for b in reusing if self._ref[b] == 0)
        return n <= len(self._free) - idle

    def acquire(self, blocks: Sequence[int]) -> None:
        """Take one more reference on each of `blocks` (prefix hits, or sharing with a fork)."""
        for b in blocks:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1
        self._note_usage()

    def allocate(self, n: int) -> list[int]:
        """Hand out `n` blocks from the front of the free list, evicting their old names."""
        if n > len(self._free):
            raise RuntimeError(f"pool exhausted: asked for {n} blocks, {len(self._free)} free")
        out: list[int] = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            h = self._hash[b]
            if h is not None:
                del self._by_hash[h]
                self._hash[b] = None
            self._ref[b] = 1
            out.append(b)
        self._note_usage()
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block. The tail of a sequence is released first, so a
        prompt's later blocks are evicted before its first ones (the ones others share)."""
        for b in reversed(blocks):
            if self._ref[b] <= 0:
                raise RuntimeError(f"block {b} released more times than it was held")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None
                if self._hash[b] is None:
                    # Holds nothing anyone can reuse: hand it out before any cached block.
                    self._free.move_to_end(b, last=False)

    def _note_usage(self) -> None:
        used = self.num_blocks - len(self._free)
        if used > self._peak_used:
            self._peak_used = used


class KVManager:
    """Per-request block tables on top of the pool: what the scheduler calls.

    A request holds `blocks` for its first `num_computed` tokens plus room for the tokens
    scheduled this step; `block_hashes` names its full blocks, so the next request with the
    same prefix can find them.
    """

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.block_size = pool.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_prefix(self, req: Request) -> list[int]:
        """Cached blocks that can stand in for the start of a new request's tokens. At least
        one token is always left to compute: the step that computes it yields the logits.
        A request still owing prompt logprobs gets none (as in vLLM): a hit would skip the
        very positions whose logits it asked for."""
        if req.needs_prompt_logprobs:
            return []
        return self.pool.lookup_prefix(req.token_ids, (req.num_tokens - 1) // self.block_size,
                                       req.chain)

    def holds(self, req: Request, num_new: int) -> bool:
        """Whether `num_new` more tokens of `req` fit the blocks it holds: most decode steps
        of most requests, which then need no allocation."""
        return req.num_computed + num_new <= len(req.blocks) * self.block_size

    def allocate(self, req: Request, num_new: int, hits: Sequence[int] = ()) -> bool:
        """Make room for `num_new` more tokens of `req` (after taking the prefix `hits`).
        Returns False, changing nothing, when the pool cannot."""
        bs = self.block_size
        if not hits and self.holds(req, num_new):
            return True
        total = req.num_computed + len(hits) * bs + num_new
        need = self.blocks_needed(total) - len(req.blocks) - len(hits)
        if not self.pool.can_allocate(max(need, 0), hits):
            return False
        if hits:
            self.pool.acquire(hits)
            req.blocks.extend(hits)
            req.block_hashes.extend(h for b in hits if (h := self.pool.block_hash(b)) is not None)
            req.num_computed += len(hits) * bs
        if need > 0:
            req.blocks.extend(self.pool.allocate(need))
        return True

    def commit(self, req: Request) -> None:
        """Name the blocks that the last step filled, so later requests can reuse them."""
        bs = self.block_size
        chain = req.chain
        while len(req.block_hashes) < req.num_computed // bs:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if req.block_hashes else None
            tokens = req.token_ids[i * bs : (i + 1) * bs]
            h = self.pool.register_full_block(req.blocks[i], parent, tokens,
                                              chain[i] if i < len(chain) else None)
            if i == len(chain):
                chain.append(h)
            req.block_hashes.append(h)

    def trim(self, req: Request) -> None:
        """Give back the blocks wholly past `req`'s computed tokens: those a checked proposal
        (engine/speculative.py) took for tokens that were not kept."""
        keep = self.blocks_needed(req.num_computed)
        if len(req.blocks) > keep:
            self.pool.release(req.blocks[keep:])
            del req.blocks[keep:]

    def free(self, req: Request) -> None:
        self.pool.release(req.blocks)
        req.blocks = []
        req.block_hashes = []
