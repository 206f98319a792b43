"""Swap preemption without a model: the host pool, the cost model's decision, the scheduler's copy
orders (checked against a fake KV store that replays them), fallback to recompute, aborts."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrylm.config import CacheConfig, ConfigError, EngineConfig, SchedulerConfig
from ferrylm.engine.block_manager import BlockManager
from ferrylm.engine.host_pool import HostBlockPool
from ferrylm.engine.preemption import PreemptionPolicy, SwapCostModel
from ferrylm.engine.request import RequestStatus
from ferrylm.engine.scheduler import RequestRejected, Scheduler
from ferrylm.outputs import FinishReason
from tests.conftest import examples
from tests.unit.test_scheduler import BS, req

# -- host pool -------------------------------------------------------------------------------


def test_host_pool_allocates_all_or_nothing_and_frees():
    pool = HostBlockPool(4)
    assert pool.allocate("a", 3) == [0, 1, 2]
    assert pool.allocate("b", 2) is None and "b" not in pool.tables  # no change
    assert pool.allocate("b", 1) == [3] and pool.num_free_blocks == 0
    pool.check_invariants({"a", "b"})
    assert pool.free("a") == [0, 1, 2] and pool.free("a") == []
    pool.check_invariants({"b"})
    with pytest.raises(ValueError):
        pool.allocate("b", 1)  # already holds blocks
    assert pool.free("b") == [3] and pool.num_free_blocks == 4


def test_host_pool_invariants_catch_double_ownership_and_strangers():
    pool = HostBlockPool(3)
    pool.allocate("a", 2)
    with pytest.raises(AssertionError):
        pool.check_invariants({"a", "b"})  # b is swapped but holds nothing
    pool.tables["b"] = [pool.tables["a"][0]]  # one block owned twice
    with pytest.raises(AssertionError):
        pool.check_invariants()


# -- cost model ------------------------------------------------------------------------------


def test_cost_model_swaps_long_contexts_recomputes_short_ones():
    cost = SwapCostModel(prefill_tokens_per_s=3000.0, copy_bytes_per_s=1.5e9, copy_overhead_s=0.5e-3)
    per_block = 368_640  # SmolLM2-135M, bf16, 16 tokens
    assert not cost.prefers_swap(1, 1, per_block)  # 0.3 ms to recompute, ~1.5 ms of fixed copy cost
    assert cost.prefers_swap(512, 32, per_block)
    policy = PreemptionPolicy("auto", per_block, cost)
    assert not policy.wants_swap(2, 1) and policy.wants_swap(256, 16)
    slow_bus = PreemptionPolicy("auto", per_block, SwapCostModel(3000.0, 1e6, 0.0))  # a 1 MB/s copy
    assert not slow_bus.wants_swap(256, 16)
    assert PreemptionPolicy("swap", per_block).wants_swap(1, 1)
    assert not PreemptionPolicy("recompute", per_block).wants_swap(10_000, 625)


def test_swap_mode_needs_swap_space():
    with pytest.raises(ConfigError, match="swap-space"):
        EngineConfig(cache=CacheConfig(swap_space=0), scheduler=SchedulerConfig(preemption_mode="swap"))
    with pytest.raises(ConfigError, match="swap-space"):
        CacheConfig(swap_space=-1)
    with pytest.raises(ConfigError, match="preemption-mode"):
        SchedulerConfig(preemption_mode="sometimes")


# -- scheduler with a fake KV store -----------------------------------------------------------


class FakeKV:
    """Slot contents of device and host blocks: a slot holds the hash of the token prefix ending at
    its position. Replays each step's copy orders, checks every scheduled request reads what it
    computed, then writes the step's new slots."""

    def __init__(self):
        self.device: dict[tuple[int, int], int] = {}
        self.host: dict[tuple[int, int], int] = {}

    def run(self, s: Scheduler, out) -> None:
        for dev, host in out.blocks_to_swap_out:
            for o in range(BS):
                self.host[host, o] = self.device.get((dev, o), -1)
        for host, dev in out.blocks_to_swap_in:
            for o in range(BS):
                self.device[dev, o] = self.host.get((host, o), -1)
        for item in out.scheduled:
            tokens = s.requests[item.request_id].token_ids
            for p in range(item.num_computed_tokens):
                assert self.device.get((item.block_ids[p // BS], p % BS)) == hash(tuple(tokens[:p + 1])), \
                    f"{item.request_id}: position {p} lost its K/V"
            for p in range(item.num_computed_tokens, item.num_computed_tokens + len(item.token_ids)):
                self.device[item.block_ids[p // BS], p % BS] = hash(tuple(tokens[:p + 1]))


def make_swap(num_blocks=12, host_blocks=32, budget=16, max_seqs=8, mode="swap", prefix=True):
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, preemption_mode=mode)
    return Scheduler(config, BlockManager(num_blocks, BS, prefix), 128, HostBlockPool(host_blocks),
                     PreemptionPolicy(mode, 1000))


def fake_step(s: Scheduler, kv: FakeKV, rng: random.Random | None = None):
    out = s.schedule()
    kv.run(s, out)
    sampled = {i.request_id: (rng.randrange(2, 20) if rng else 7) for i in out.scheduled if i.sample}
    s.update(out, sampled)
    s.check_invariants()
    return out


def drain(s: Scheduler, kv: FakeKV, limit=2000):
    outs = []
    for _ in range(limit):
        if not s.has_unfinished:
            break
        outs.append(fake_step(s, kv))
    assert not s.has_unfinished
    return outs


def test_swap_out_and_back_in_keeps_the_kv():
    s, kv = make_swap(num_blocks=8), FakeKV()
    for i in range(4):
        s.add_request(req(f"r{i}", n_prompt=6, max_tokens=12, t=float(i), first=10 * i))
    outs = drain(s, kv)
    stats = s.stats()
    assert stats.num_swapped_out > 0 and stats.num_swapped_in == stats.num_swapped_out
    assert stats.num_preemptions == stats.num_swapped_out and stats.num_swap_fallbacks == 0
    assert not any(o.preempted_ids for o in outs)  # no recompute
    assert not any(o.blocks_to_swap_out and o.blocks_to_swap_in for o in outs)  # one direction per step
    assert s.block_manager.num_free_blocks == 8 and s.host_pool.num_free_blocks == 32


def test_swapped_request_keeps_its_place_and_status():
    s, kv = make_swap(num_blocks=6), FakeKV()
    s.add_request(req("hi", n_prompt=8, max_tokens=12, priority=0, t=0.0))
    s.add_request(req("lo", n_prompt=8, max_tokens=12, priority=1, t=1.0, first=50))
    while "lo" not in s.host_pool.tables:
        fake_step(s, kv)
    lo = s.requests["lo"]
    assert lo.status == RequestStatus.SWAPPED and lo in s.waiting and lo.num_computed_tokens > 0
    assert s.stats().num_swapped == 1 and s.stats().num_waiting == 0
    drain(s, kv)


def test_swap_falls_back_to_recompute_when_the_host_pool_is_full():
    s, kv = make_swap(num_blocks=8, host_blocks=1), FakeKV()
    for i in range(4):
        s.add_request(req(f"r{i}", n_prompt=6, max_tokens=12, t=float(i), first=10 * i))
    outs = drain(s, kv)
    stats = s.stats()
    assert stats.num_swap_fallbacks > 0 and any(o.preempted_ids for o in outs)
    assert stats.num_preemptions == stats.num_swapped_out + stats.num_swap_fallbacks
    assert s.block_manager.num_free_blocks == 8 and s.host_pool.num_free_blocks == 1


def test_recompute_mode_never_swaps_and_no_host_pool_means_recompute():
    for s in (make_swap(num_blocks=8, mode="recompute"), make_swap(num_blocks=8, host_blocks=0, mode="auto")):
        kv = FakeKV()
        for i in range(4):
            s.add_request(req(f"r{i}", n_prompt=6, max_tokens=12, t=float(i), first=10 * i))
        drain(s, kv)
        assert s.stats().num_preemptions > 0 and s.stats().num_swapped_out == 0
        assert s.stats().num_swap_fallbacks == 0


def test_aborting_a_swapped_request_frees_its_host_blocks():
    s, kv = make_swap(num_blocks=6), FakeKV()
    s.add_request(req("a", n_prompt=8, max_tokens=12, t=0.0))
    s.add_request(req("b", n_prompt=8, max_tokens=12, t=1.0, first=50))
    while not s.host_pool.tables:
        fake_step(s, kv)
    (victim,) = s.host_pool.tables
    s.finish_request(victim, FinishReason.ABORT)
    s.check_invariants()
    assert s.host_pool.num_free_blocks == 32
    drain(s, kv)
    assert s.block_manager.num_free_blocks == 6


actions = st.lists(st.tuples(st.sampled_from(["add", "add", "step", "step", "abort"]), st.integers(0, 9),
                             st.integers(1, 16), st.integers(1, 16), st.integers(-1, 2)), min_size=10, max_size=60)


@settings(max_examples=examples(100), deadline=None)
@given(actions, st.integers(8, 16), st.integers(0, 12), st.booleans(), st.integers(0, 2**16))
def test_random_add_step_abort_with_swap(ops, num_blocks, host_blocks, prefix, seed):
    """Swap mode on a tiny pool: invariants of both pools after every operation, every scheduled
    request reads back the K/V it computed (through swaps and prefix sharing), nothing leaks."""
    s, kv, rng = make_swap(num_blocks, host_blocks, budget=12, max_seqs=4, prefix=prefix), FakeKV(), \
        random.Random(seed)
    ids = 0
    for action, pick, n_prompt, max_tokens, priority in ops:
        if action == "add":
            try:
                s.add_request(req(f"r{ids}", n_prompt, max_tokens, priority, float(ids), eos=(3,), first=pick % 3))
            except RequestRejected:
                pass
            ids += 1
        elif action == "abort" and s.requests:
            swapped = sorted(s.host_pool.tables)
            victim = swapped[0] if swapped and pick % 2 else sorted(s.requests)[pick % len(s.requests)]
            s.finish_request(victim, FinishReason.ABORT)
            assert victim not in s.host_pool.tables
        else:
            fake_step(s, kv, rng)
        s.check_invariants()
    drain(s, kv)
    assert s.block_manager.num_free_blocks == num_blocks and s.host_pool.num_free_blocks == host_blocks
