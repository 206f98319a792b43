"""BlockManager: allocation, prefix hits, LRU eviction, freeing; invariants after every operation."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ferrylm.engine.block_manager import BlockManager, block_hashes
from tests.conftest import examples

BS = 4


def test_allocate_and_free_returns_every_block():
    bm = BlockManager(8, BS)
    tokens = list(range(10))
    assert bm.allocate_slots("a", tokens, 0, 10)
    assert len(bm.block_table("a")) == 3
    bm.check_invariants()
    bm.free("a")
    bm.check_invariants()
    assert bm.num_free_blocks == 8


def test_allocation_fails_without_side_effects():
    bm = BlockManager(2, BS)
    assert not bm.allocate_slots("a", list(range(9)), 0, 9)
    assert bm.block_table("a") == [] and bm.num_free_blocks == 2
    bm.check_invariants()


def test_prefix_hit_shares_blocks_and_leaves_one_token():
    bm = BlockManager(16, BS)
    a = list(range(12))
    bm.allocate_slots("a", a, 0, 12)
    # identical prompt: at most 2 of 3 full blocks may be reused (one token must be computed)
    hit = bm.find_cached_prefix(a)
    assert hit == bm.block_table("a")[:2]
    b = a[:8] + [99, 98, 97]
    hit_b = bm.find_cached_prefix(b)
    assert hit_b == bm.block_table("a")[:2]
    assert bm.allocate_slots("b", b, 8, 3, hit_b)
    assert bm.block_table("b")[:2] == bm.block_table("a")[:2]
    assert bm.pool.blocks[hit_b[0]].ref_cnt == 2
    bm.check_invariants()


def test_freed_blocks_stay_cached_until_evicted_lru():
    bm = BlockManager(4, BS)
    a = list(range(8))
    bm.allocate_slots("a", a, 0, 8)
    bm.free("a")
    assert bm.find_cached_prefix(a + [1]) == [0, 1]  # still findable after free
    assert bm.usage == 0.0
    bm.allocate_slots("x", [7] * 8, 0, 8)  # takes the never-used blocks 2, 3 first
    assert bm.find_cached_prefix(a + [1]) == [0, 1]
    bm.allocate_slots("y", [5] * 4, 0, 4)  # now must evict: the tail block of "a" goes first
    assert bm.find_cached_prefix(a + [1]) == [0]
    bm.check_invariants()


def test_hit_on_free_cached_block_counts_against_capacity():
    bm = BlockManager(3, BS)
    a = list(range(8))
    bm.allocate_slots("a", a, 0, 8)
    bm.free("a")
    hit = bm.find_cached_prefix(a + [1, 2, 3, 4, 5])
    assert len(hit) == 2
    # needs 2 cached (both free) + 2 new = 4 > 3 blocks
    assert not bm.allocate_slots("b", a + [1, 2, 3, 4, 5], 8, 5, hit)
    bm.check_invariants()


def test_block_hashes_are_chained():
    a = block_hashes(list(range(8)), BS)
    b = block_hashes([0, 1, 2, 3] + [9, 9, 9, 9], BS)
    c = block_hashes([9, 9, 9, 9], BS)
    assert a[0] == b[0] and a[1] != b[1] and b[1] != c[0]


ops = st.lists(st.tuples(st.sampled_from(["add", "grow", "free"]), st.integers(0, 5), st.integers(1, 12),
                         st.integers(0, 2)), max_size=60)


@settings(max_examples=examples(150), deadline=None)
@given(ops)
def test_random_operations_keep_invariants(operations):
    bm = BlockManager(10, BS)
    live: dict[str, list[int]] = {}
    for op, rid_n, n, prefix in operations:
        rid = f"r{rid_n}"
        if op == "add" and rid not in live:
            tokens = [prefix] * 8 + list(range(n))  # few distinct prefixes → many hits
            hit = bm.find_cached_prefix(tokens)
            if bm.allocate_slots(rid, tokens, len(hit) * BS, len(tokens) - len(hit) * BS, hit):
                live[rid] = tokens
        elif op == "grow" and rid in live:
            tokens = live[rid]
            computed = len(tokens)
            grown = tokens + list(range(n))
            before = list(bm.block_table(rid))
            if bm.allocate_slots(rid, grown, computed, n):
                live[rid] = grown
                assert len(bm.block_table(rid)) * BS >= len(grown)
            else:
                assert bm.block_table(rid) == before
        elif op == "free" and rid in live:
            bm.free(rid)
            del live[rid]
        bm.check_invariants()
    for r in list(live):
        bm.free(r)
    bm.check_invariants()
    assert bm.num_free_blocks == 10
