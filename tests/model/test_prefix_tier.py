"""The prefix cache's host tier (--kv-offload-cpu-gib): blocks evicted from a small device pool are
kept in host memory and loaded back for the next turn of a conversation; greedy outputs are
identical with the tier on and off, and the tier's hits are counted."""

from __future__ import annotations

import pytest

from ferrylm.engine.block_manager import BlockManager
from ferrylm.engine.llm import LLM
from ferrylm.engine.prefix_tier import HostPrefixTier
from ferrylm.sampling_params import SamplingParams
from tests.model.tiny_models import add_word_tokenizer, make_tiny_model


def test_tier_is_lru_and_reuses_a_taken_block_only_next_step():
    tier = HostPrefixTier(first_id=4, num_blocks=2)
    a, b, c = (0, (1,)), (0, (2,)), (0, (3,))
    assert tier.offload(10, a) == (10, 4) and tier.offload(11, b) == (11, 5)
    assert tier.offload(12, a) is None  # already held: refreshed, not copied again
    assert tier.offload(13, c) == (13, 5)  # full: b (least recently used) gives its block
    assert not tier.holds(b) and tier.take(a) == 4
    assert tier.offload(14, b) == (14, 5)  # block 4 is being read back this step: c's is taken instead
    tier.end_step()
    assert tier.offload(15, (0, (9,))) == (15, 4)
    tier.check_invariants()


def test_block_manager_offloads_evicted_blocks_and_loads_them_back():
    bm = BlockManager(4, 2, tier=HostPrefixTier(0, 8))
    first = [1, 2, 3, 4, 5, 6, 7]  # 3 full blocks + 1 token
    assert bm.allocate_slots("a", first, 0, 7)
    bm.free("a")
    assert bm.take_tier_orders() == ([], [])
    assert bm.allocate_slots("b", [9, 9, 8, 8, 7, 7, 6, 6], 0, 8)  # all 4 blocks: evicts a's 3 cached ones
    evicted, into = bm.take_tier_orders()
    assert len(evicted) == 3 and into == []
    bm.free("b")
    keys = bm.tier_continuation(first, [])
    assert len(keys) == 3 and bm.find_cached_prefix(first) == []
    assert bm.allocate_slots("c", first, 6, 1, [], tier_keys=keys)
    _, into = bm.take_tier_orders()
    assert sorted(h for h, _ in into) == sorted(h for _, h in evicted)  # the same host blocks, read back
    assert [d for _, d in into] == bm.block_table("c")[:3]
    assert bm.find_cached_prefix(first) == bm.block_table("c")[:3]  # registered again in the device pool
    bm.check_invariants()
    bm.tier.check_invariants()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return add_word_tokenizer(make_tiny_model("llama", tmp_path_factory.mktemp("tier") / "base"))


def _two_turns(llm: LLM) -> list[list[int]]:
    """Six conversations of two turns: the second appends the first answer and a tool result."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    contexts = [[1] + [10 + 17 * s + i for i in range(40)] for s in range(6)]
    first = llm.generate([{"prompt_token_ids": c} for c in contexts], params, use_tqdm=False)
    second = [c + list(o.outputs[0].token_ids) + [200 + s, 201, 202, 203] for s, (c, o) in
              enumerate(zip(contexts, first))]
    outs = llm.generate([{"prompt_token_ids": p} for p in second], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in first + outs]


def test_outputs_identical_with_the_tier_and_hits_counted(tiny):
    """A 16-block device pool (128 tokens) for six 40-token contexts: without the tier the second
    turn recomputes what was evicted; with it, those blocks come back from host memory."""
    common = dict(dtype="float32", block_size=8, num_gpu_blocks_override=16, max_num_seqs=2, enforce_eager=True)
    plain = LLM(str(tiny), **common)
    tiered = LLM(str(tiny), kv_offload_cpu_gib=0.01, **common)
    uncached = LLM(str(tiny), enable_prefix_caching=False, **common)
    expected = _two_turns(uncached)
    assert _two_turns(plain) == expected
    assert _two_turns(tiered) == expected
    with_tier, without = tiered.engine.stats(), plain.engine.stats()
    assert with_tier.kv_offload_hit_tokens >= 6 * 32 and with_tier.kv_offload_blocks_in > 0
    assert with_tier.prefix_cache_hits - without.prefix_cache_hits >= with_tier.kv_offload_hit_tokens // 2
    assert with_tier.kv_offload_blocks_used <= with_tier.kv_offload_blocks_total
    tiered.engine.scheduler.check_invariants()
    tiered.engine.block_manager.tier.check_invariants()


def test_a_flooding_tenant_recycles_its_own_share():
    """Full, the tier takes from the owner holding most: a tenant pushing 50 blocks through a 4-block
    tier does not flush the other tenant's 2."""
    tier = HostPrefixTier(first_id=0, num_blocks=4)
    victim = [(1, (v,)) for v in range(2)]
    for i, key in enumerate(victim):
        assert tier.offload(i, key, owner=7) is not None
    for i in range(50):
        assert tier.offload(100 + i, (2, (i,)), owner=9) is not None
    assert all(tier.holds(key) for key in victim) and tier.num_used == 4
    assert tier.holds((2, (49,))) and not tier.holds((2, (0,)))  # the flood keeps its newest
    tier.check_invariants()
