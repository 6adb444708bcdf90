from __future__ import annotations

import pytest

from engine.kv.block_pool import BlockPool
from engine.kv.manager import KVCacheManager
from engine.types.request import Request, SamplingParams


def test_allocate_release_roundtrip():
    pool = BlockPool(4, 2)
    a = pool.allocate(3)
    assert pool.num_free == 1 and all(pool.ref_cnt[b] == 1 for b in a)
    pool.check_invariants([a])
    pool.release(a)
    assert pool.num_free == 4
    pool.check_invariants([])
    with pytest.raises(RuntimeError):
        pool.allocate(5)


def test_release_more_than_referenced_raises():
    pool = BlockPool(2, 2)
    (b,) = pool.allocate(1)
    pool.release([b])
    with pytest.raises(RuntimeError):
        pool.release([b])


def test_invariant_check_catches_bad_ref_count():
    pool = BlockPool(3, 2)
    table = pool.allocate(2)
    with pytest.raises(AssertionError):
        pool.check_invariants([table[:1]])


def test_cached_free_block_is_reusable_until_evicted():
    pool = BlockPool(2, 2)
    (b,) = pool.allocate(1)
    pool.cache(b, b"h")
    pool.release([b])
    assert pool.lookup(b"h") == b  # still findable while free
    pool.touch([b])
    assert pool.ref_cnt[b] == 1 and pool.num_free == 1
    pool.release([b])
    pool.allocate(2)  # reallocation evicts the hash
    assert pool.lookup(b"h") is None
    pool.check_invariants([[0], [1]])


def test_lookahead_churn_reuses_empty_blocks_before_evicting_cached_ones():
    """Speculation allocates lookahead blocks and gives back those holding only rejected
    drafts after every step: those come back first, so a cached prefix is never evicted
    while an empty block is free."""
    pool = BlockPool(4, 2)
    cached = pool.allocate(2)
    for i, block in enumerate(cached):
        pool.cache(block, bytes([i]))
    pool.release(cached)  # a finished request's prefix: free, still findable
    running = pool.allocate(1)  # the one empty block
    for _ in range(10):  # each step: one lookahead block out, back unused
        lookahead = pool.allocate(1)
        pool.release(lookahead)
    assert [pool.lookup(bytes([i])) for i in range(2)] == cached
    pool.allocate(1)  # the pool's last empty block: still no eviction
    assert [pool.lookup(bytes([i])) for i in range(2)] == cached
    pool.allocate(1)  # only now is the least recently freed cached block taken
    assert pool.lookup(bytes([0])) is None and pool.lookup(bytes([1])) == cached[1]
    pool.release(running)


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def test_allocate_slots_and_trim():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = _req("a", list(range(10)))
    assert kv.allocate_slots(req, 10, num_lookahead=3)  # 13 tokens -> 4 blocks
    assert len(kv.block_table("a")) == 4
    req.num_computed_tokens = 10
    assert kv.trim(req, 10) == 1  # the block holding only positions 12.. goes back
    assert kv.num_free_blocks == 5
    assert not kv.allocate_slots(req, 100)  # too big: nothing changes
    assert len(kv.block_table("a")) == 3
    kv.check_invariants()
    kv.free(req)
    assert kv.num_free_blocks == 8
    kv.check_invariants()


def test_prefix_sharing_only_for_verified_full_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = _req("a", list(range(10)))
    kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    kv.cache_verified(a, 10)  # two full blocks hashed, the partial third not
    b = _req("b", list(range(9)) + [99])
    cached = kv.find_cached_prefix(b)
    assert len(cached) == 2
    assert kv.allocate_slots(b, 2, cached_blocks=cached)
    shared = kv.block_table("b")[:2]
    assert shared == kv.block_table("a")[:2]
    assert all(kv.pool.ref_cnt[blk] == 2 for blk in shared)
    # Only tokens passed as cacheable are hashed (drafts never are).
    c = _req("c", list(range(100, 112)))
    kv.allocate_slots(c, 12)
    kv.cache_verified(c, 5)
    assert len(kv.find_cached_prefix(_req("d", list(range(100, 112))))) == 1
    kv.check_invariants()


def test_prefix_match_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = _req("a", list(range(8)))
    kv.allocate_slots(a, 8)
    kv.cache_verified(a, 8)
    assert len(kv.find_cached_prefix(_req("b", list(range(8))))) == 1


def test_failed_allocation_with_cached_prefix_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = _req("a", list(range(9)))
    kv.allocate_slots(a, 9)
    kv.cache_verified(a, 8)
    kv.free(a)  # its hashed blocks are free but still findable
    b = _req("b", list(range(8)) + [50] * 20)
    cached = kv.find_cached_prefix(b)
    assert len(cached) == 2
    assert not kv.allocate_slots(b, 20, cached_blocks=cached)  # needs 7 blocks, pool has 4
    assert kv.block_table("b") == [] and all(kv.pool.ref_cnt[x] == 0 for x in cached)
    kv.check_invariants()
