"""The block pool and per-request block tables: exact ids, ref counts and free-list order."""

from __future__ import annotations

import pytest

from nanoserve.engine.kv import BlockPool, KVManager, chain_hash
from nanoserve.engine.request import Request
from nanoserve.sampling.params import SamplingParams


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=8), 8, 0, 0)


def test_allocate_hands_out_from_the_front_in_order() -> None:
    pool = BlockPool(6, 4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert pool.free_list() == [5]
    assert [pool.ref_count(b) for b in range(6)] == [1, 1, 1, 1, 1, 0]
    s = pool.statistics()
    assert (s.free, s.used, s.peak_used) == (1, 5, 5)


def test_release_puts_unnamed_blocks_first_and_named_blocks_last() -> None:
    pool = BlockPool(6, 4)
    a = pool.allocate(3)  # [0, 1, 2]
    pool.register_full_block(a[0], None, [1, 2, 3, 4])  # block 0 now carries a name
    pool.release(a)
    # Unnamed 1 and 2 go to the front (reused first), named 0 to the back (evicted last).
    assert pool.free_list() == [1, 2, 3, 4, 5, 0]
    assert pool.statistics().peak_used == 3


def test_exhausted_pool_raises_and_double_release_raises() -> None:
    pool = BlockPool(2, 4)
    blocks = pool.allocate(2)
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.allocate(1)
    pool.release(blocks)
    with pytest.raises(RuntimeError, match="released more times"):
        pool.release([0])


def test_prefix_hit_after_the_first_request_finished() -> None:
    pool = BlockPool(8, 4)
    kv = KVManager(pool)
    tokens = list(range(100, 114))  # 14 tokens: 3 full blocks + 2
    first = _req("a", tokens)
    assert kv.allocate(first, 14)
    assert first.blocks == [0, 1, 2, 3]
    first.num_computed = 14
    kv.commit(first)
    assert first.block_hashes == [
        chain_hash(None, tokens[0:4]),
        chain_hash(first.block_hashes[0], tokens[4:8]),
        chain_hash(first.block_hashes[1], tokens[8:12]),
    ]
    kv.free(first)
    # Named blocks go to the back, tail first: the prompt's first block is evicted last.
    assert pool.free_list() == [3, 4, 5, 6, 7, 2, 1, 0]

    second = _req("b", tokens[:12] + [7, 7, 7])
    hits = kv.find_prefix(second)
    assert hits == [0, 1, 2]
    assert kv.allocate(second, 3, hits)
    assert second.num_computed == 12
    assert second.blocks == [0, 1, 2, 3]
    assert [pool.ref_count(b) for b in second.blocks] == [1, 1, 1, 1]
    s = pool.statistics()
    assert (s.prefix_queries, s.prefix_hits) == (3, 3)


def test_shared_blocks_count_references_and_stay_until_the_last_holder_leaves() -> None:
    pool = BlockPool(8, 4)
    kv = KVManager(pool)
    tokens = list(range(9))
    a = _req("a", tokens)
    kv.allocate(a, 9)
    a.num_computed = 9
    kv.commit(a)
    b = _req("b", tokens)
    hits = kv.find_prefix(b)
    assert hits == [0, 1]  # 8 tokens; the 9th is recomputed for its logits
    kv.allocate(b, 1, hits)
    assert b.blocks == [0, 1, 3]
    assert [pool.ref_count(x) for x in range(4)] == [2, 2, 1, 1]
    kv.free(a)
    assert [pool.ref_count(x) for x in range(4)] == [1, 1, 0, 1]
    assert pool.free_list() == [2, 4, 5, 6, 7]
    kv.free(b)
    assert pool.num_free == 8


def test_at_least_one_token_is_left_to_compute_on_a_full_hit() -> None:
    pool = BlockPool(8, 4)
    kv = KVManager(pool)
    a = _req("a", list(range(8)))
    kv.allocate(a, 8)
    a.num_computed = 8
    kv.commit(a)
    kv.free(a)
    b = _req("b", list(range(8)))
    assert kv.find_prefix(b) == [0]


def test_can_allocate_counts_idle_hits_as_taken() -> None:
    pool = BlockPool(3, 4)
    kv = KVManager(pool)
    a = _req("a", list(range(9)))
    kv.allocate(a, 9)
    a.num_computed = 9
    kv.commit(a)
    kv.free(a)
    # All 3 free, 2 of them named. Reusing both leaves room for exactly 1 new block.
    assert pool.can_allocate(1, [0, 1])
    assert not pool.can_allocate(2, [0, 1])


def test_eviction_drops_the_name_so_a_later_lookup_misses() -> None:
    pool = BlockPool(2, 4)
    kv = KVManager(pool)
    a = _req("a", list(range(5)))
    kv.allocate(a, 5)
    a.num_computed = 5
    kv.commit(a)
    kv.free(a)
    assert pool.free_list() == [1, 0]
    pool.allocate(2)  # takes 1, then evicts 0
    assert pool.block_hash(0) is None
    assert pool.lookup_prefix(list(range(5)), 1) == []


def test_prefix_caching_off_never_hits() -> None:
    pool = BlockPool(4, 4, prefix_caching=False)
    kv = KVManager(pool)
    a = _req("a", list(range(9)))
    kv.allocate(a, 9)
    a.num_computed = 9
    kv.commit(a)
    kv.free(a)
    assert kv.find_prefix(_req("b", list(range(9)))) == []


def test_a_waiting_request_names_its_blocks_once_however_often_it_is_looked_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A queue head that finds no room is looked up again every step: the names of its
    # blocks are a function of its tokens, computed once (Request.chain) and then reused
    # by later look-ups and by `commit`.
    import nanoserve.engine.kv as kv_module

    pool = BlockPool(8, 4)
    kv = KVManager(pool)
    tokens = list(range(100, 114))
    first = _req("a", tokens)
    assert kv.allocate(first, 14)
    first.num_computed = 14
    kv.commit(first)

    named: list[tuple[int | None, tuple[int, ...]]] = []

    def counting(parent: int | None, toks: list[int]) -> int:
        named.append((parent, tuple(toks)))
        return chain_hash(parent, toks)

    monkeypatch.setattr(kv_module, "chain_hash", counting)
    second = _req("b", tokens[:8] + [7, 7, 7, 7, 7, 7, 7])  # 3 full blocks, the third new
    for _ in range(4):
        assert kv.find_prefix(second) == [0, 1]
    assert len(named) == 3  # blocks 0, 1 (hits) and 2 (the miss), each named once
    assert second.chain == [*first.block_hashes[:2], chain_hash(first.block_hashes[1],
                                                                [7, 7, 7, 7])]
    s = pool.statistics()
    assert (s.prefix_queries, s.prefix_hits) == (12, 8)  # every look-up is still counted

    assert kv.allocate(second, 7, [0, 1])
    second.num_computed = 15
    kv.commit(second)
    assert len(named) == 3  # commit took block 2's name from the chain
    assert second.block_hashes == second.chain
    assert pool.block_hash(second.blocks[2]) == second.chain[2]
