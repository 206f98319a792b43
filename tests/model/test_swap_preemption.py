"""Swap preemption with the real model: outputs under a KV pool too small for the load, with swap
(forced, auto, and a host pool too small so some swaps fall back) equal those of an unconstrained
run token for token (greedy and seeded sampling); both pools' invariants after every step; and the
copy path itself on quantized (int8, scales after the codes) caches."""

from __future__ import annotations

import pytest
import torch

from ferrylm import SamplingParams
from ferrylm.model.attention import kv_quant
from ferrylm.model.kv_swap import HostKVSwap, swap_bytes_per_block
from tests.conftest import chat_prompt_ids, engine_like, requires_smollm2, run_to_completion
from tests.model.prompts import SIXTEEN_PROMPTS

NEW = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=NEW, ignore_eos=True)


def _submit(engine, prompts):
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SAMPLED if i == 1 else GREEDY)


@pytest.fixture(scope="module")
def prompts(llm_fp32):
    return chat_prompt_ids(llm_fp32, SIXTEEN_PROMPTS[:6])


@pytest.fixture(scope="module")
def unconstrained(llm_fp32, prompts):
    engine = engine_like(llm_fp32, max_num_batched_tokens=1024)
    _submit(engine, prompts)
    return run_to_completion(engine)


@requires_smollm2
@pytest.mark.parametrize("mode, host_blocks", [("swap", None), ("auto", 3)])
def test_outputs_identical_under_swap_preemption(llm_fp32, prompts, unconstrained, mode, host_blocks):
    longest = max(map(len, prompts)) + NEW
    runner = llm_fp32.engine.executor
    swap_space = 4.0 if host_blocks is None else host_blocks * runner.swap_bytes_per_block / (1 << 30)
    engine = engine_like(llm_fp32, num_blocks=longest // 16 + 4, max_num_batched_tokens=1024,
                         preemption_mode=mode, swap_space=swap_space)
    _submit(engine, prompts)
    assert run_to_completion(engine, check=True) == unconstrained
    stats = engine.stats()
    assert stats.num_swapped_out > 0 and stats.num_swapped_in == stats.num_swapped_out
    if host_blocks is None:
        assert stats.num_preemptions == stats.num_swapped_out and stats.num_swap_fallbacks == 0
    else:
        assert stats.num_swap_fallbacks > 0  # the small host pool filled up: some victims recomputed
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.scheduler.host_pool.num_free_blocks == engine.scheduler.host_pool.num_blocks


@pytest.mark.parametrize("cache_dtype", ["auto", "int8", "fp8"])
def test_swap_copies_every_part_of_a_block(cache_dtype):
    """Out of one device block, into another: the block reads back the same (int8's row scales
    travel with their codes); the other blocks are untouched."""
    torch.manual_seed(0)
    shape = (6, 4, 2, 8)
    dtype = kv_quant.storage_dtype(cache_dtype, torch.float32)
    caches = [kv_quant.allocate(shape, dtype, "cpu") for _ in range(2)]
    rows = torch.randn(6 * 4, 2, 8)
    for cache in caches:
        if cache_dtype == "auto":
            cache.copy_(rows.view(shape))
        else:
            kv_quant.write(rows, cache, torch.arange(24))

    def read(cache, block):
        blocks = torch.tensor([block])
        return cache[blocks].float() if cache_dtype == "auto" else kv_quant.read_blocks(cache, blocks, torch.float32)

    before = [[read(c, b) for b in range(6)] for c in caches]
    swap = HostKVSwap(caches, num_blocks=3)
    assert swap_bytes_per_block(caches) == 2 * (4 * 2 * 8 * dtype.itemsize + (4 * 2 * 2 if dtype == torch.int8 else 0))
    swap.swap_out([(1, 2), (4, 0)])
    for cache in caches:
        cache.view(torch.uint8)[1].zero_()
        if dtype == torch.int8:
            kv_quant.scales(cache)[1].zero_()
    swap.swap_in([(2, 5), (0, 1)])  # block 1's K/V into block 5, block 4's into block 1
    for c, cache in enumerate(caches):
        assert torch.equal(read(cache, 5), before[c][1]) and torch.equal(read(cache, 1), before[c][4])
        for b in (0, 2, 3, 4):
            assert torch.equal(read(cache, b), before[c][b])


def _tiny_runner(cache_dtype: str = "auto", speculative=None):
    from ferrylm.config import CacheConfig
    from ferrylm.model.runner import ModelRunner
    from tests.gpu.random_model import RandomCheckpoint
    from tests.model.test_speculative_models import TINY

    return ModelRunner(RandomCheckpoint(TINY, seed=3, std=0.5),
                       CacheConfig(block_size=16, num_blocks=257, cache_dtype=cache_dtype, swap_space=0.01),
                       torch.float32, torch.device("cpu"), 512, max_num_seqs=64, enforce_eager=True,
                       attention="torch", speculative=speculative)


def test_runner_swaps_the_draft_models_kv_too():
    """layer_skip keeps its own K/V indexed by the same block ids: a swap moves it with the target's."""
    from ferrylm.config import SpeculativeConfig
    from ferrylm.scheduler_output import SchedulerOutput

    runner = _tiny_runner(speculative=SpeculativeConfig("layer_skip", 2, num_layers=1))
    draft = runner.speculator.model_proposer.kv_caches
    caches = [t for kv in runner.kv_caches + draft for t in kv]
    for t in caches:
        t[3].normal_()
    saved = [t[3].clone() for t in caches]
    runner.execute(SchedulerOutput([], [], [], 0, (), blocks_to_swap_out=((3, 0),)))
    for t in caches:
        t[3].zero_()
    runner.execute(SchedulerOutput([], [], [], 0, (), blocks_to_swap_in=((0, 7),)))
    assert all(torch.equal(t[7], s) for t, s in zip(caches, saved))
    assert runner.swap_bytes_per_block == swap_bytes_per_block(caches)


@pytest.mark.parametrize("cache_dtype", ["auto", "int8"])
def test_tiny_model_swap_run_equals_unconstrained(cache_dtype):
    """A random 2-layer model, 8 requests on a 12-block pool with swap: greedy output as with room."""
    from tests.gpu.random_model import build_engine
    from tests.model.test_speculative_models import _prompts

    runner = _tiny_runner(cache_dtype)
    prompts = _prompts(8)
    results = []
    for num_blocks, mode in ((256, "recompute"), (12, "swap")):
        base = build_engine(runner, num_blocks=num_blocks, max_model_len=512, max_num_seqs=8,
                            max_num_batched_tokens=256)
        engine = type(base)(base.config.with_scheduler(preemption_mode=mode), runner, base.tokenizer, 512)
        for i, ids in enumerate(prompts):
            engine.add_request(str(i), ids, GREEDY)
        results.append(run_to_completion(engine, check=True))
    assert results[1] == results[0]
    assert engine.stats().num_swapped_out > 0 and engine.stats().num_swap_fallbacks == 0
    assert engine.scheduler.host_pool.num_free_blocks == engine.scheduler.host_pool.num_blocks


def test_tensor_parallel_ranks_swap_their_shards(tmp_path):
    """TP=2 on a 6-block pool with swap: each rank copies its own shard of the same blocks, so the
    output equals TP=1 with room (a rank that skipped the copy would read stale K/V)."""
    from ferrylm import LLM
    from tests.model.tiny_models import add_word_tokenizer, assert_same_greedy, make_tiny_model

    directory = str(add_word_tokenizer(make_tiny_model("llama", tmp_path / "llama")))
    prompts = [{"prompt_token_ids": [1, 5, 9, 33, 70, 100 + i, 7] * (1 + 3 * i)} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
    plain = LLM(directory, dtype="float32", enforce_eager=True).generate(prompts, params, use_tqdm=False)
    tp = LLM(directory, dtype="float32", tensor_parallel_size=2, num_gpu_blocks_override=8, preemption_mode="swap",
             swap_space=0.01)
    try:
        swapped = tp.generate(prompts, params, use_tqdm=False)
        stats = tp.engine.stats()
    finally:
        tp.shutdown()
    assert_same_greedy(plain, swapped)
    assert stats.num_swapped_out > 0 and stats.num_swap_fallbacks == 0
