"""KV blocks moved between two engines (the core of disaggregated prefill/decode): the receiving
engine starts a request from the sender's blocks as a prefix hit and generates exactly what it would
have generated alone; garbage blocks would change the output (they really are read, not recomputed);
the wire format round-trips; mismatched layouts and hashes are refused; the accounting holds."""

from __future__ import annotations

import pytest
import torch

from ferrylm import SamplingParams
from ferrylm.config import CacheConfig
from ferrylm.kv_transfer import KVBlocks, KVLayoutMismatch
from tests.conftest import run_to_completion
from tests.gpu.random_model import RandomCheckpoint, build_engine, model_config

TINY = model_config("tiny", max_positions=512)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _engine(num_blocks: int = 64, seed: int = 3, block_size: int = 16):
    from ferrylm.model.runner import ModelRunner

    runner = ModelRunner(RandomCheckpoint(TINY, seed=seed, std=0.5), CacheConfig(block_size=block_size,
                         num_blocks=num_blocks + 1), torch.float32, torch.device("cpu"), 512, max_num_seqs=16,
                         enforce_eager=True, attention="torch")
    return build_engine(runner, num_blocks=num_blocks, max_model_len=512, max_num_seqs=16,
                        max_num_batched_tokens=512, block_size=block_size)


def _generate(engine, prompt: list[int], params: SamplingParams = GREEDY, rid: str = "r") -> list[int]:
    engine.add_request(rid, prompt, params)
    return run_to_completion(engine, check=True)[rid]


PROMPT = torch.randint(0, 320, (75,), generator=torch.Generator().manual_seed(5)).tolist()  # 4 full blocks + 11


def test_decode_engine_continues_from_the_prefill_engines_blocks():
    expected = _generate(_engine(), PROMPT)
    prefill, decode = _engine(), _engine()
    _generate(prefill, PROMPT, SamplingParams(temperature=0.0, max_tokens=1))  # computes and caches the blocks
    kv = KVBlocks.from_bytes(prefill.export_prefix_kv(PROMPT).to_bytes())
    assert len(kv.hashes) == 4
    assert decode.import_prefix_kv(PROMPT, kv) == 4
    decode.block_manager.check_invariants()
    assert decode.block_manager.num_free_blocks == decode.block_manager.num_blocks  # cached, unreferenced
    assert decode.import_prefix_kv(PROMPT, kv) == 0  # already cached: nothing written twice
    assert _generate(decode, PROMPT) == expected
    assert decode.stats().prefix_cache_hits == 4 * 16  # the transferred blocks were used, not recomputed

    garbage = _engine()
    garbage.import_prefix_kv(PROMPT, kv._replace(data=torch.randn_like(kv.data)))
    assert _generate(garbage, PROMPT) != expected  # the imported K/V is what attention reads


def test_refusals_and_a_pool_too_small_for_the_whole_prefix():
    prefill = _engine()
    _generate(prefill, PROMPT, SamplingParams(temperature=0.0, max_tokens=1))
    kv = prefill.export_prefix_kv(PROMPT)
    with pytest.raises(ValueError, match="hashes"):
        _engine().import_prefix_kv(PROMPT[::-1], kv)
    with pytest.raises(KVLayoutMismatch):
        _engine(block_size=32).import_prefix_kv(PROMPT, kv)
    with pytest.raises(ValueError, match="not a KV-blocks body"):
        KVBlocks.from_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    small = _engine(num_blocks=2)
    assert small.import_prefix_kv(PROMPT, kv) == 2  # the chain's first 2 blocks: all that fits
    small.block_manager.check_invariants()
    assert len(small.block_manager.cached_blocks(PROMPT)) == 2
    assert len(_engine().export_prefix_kv(PROMPT).hashes) == 0  # nothing cached, nothing sent
