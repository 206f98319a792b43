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
    assert decode.import_prefix_kv(kv) == 4
    decode.block_manager.check_invariants()
    assert decode.block_manager.num_free_blocks == decode.block_manager.num_blocks  # cached, unreferenced
    assert decode.import_prefix_kv(kv) == 0  # already cached: nothing written twice
    assert _generate(decode, PROMPT) == expected
    assert decode.stats().prefix_cache_hits == 4 * 16  # the transferred blocks were used, not recomputed

    garbage = _engine()
    garbage.import_prefix_kv(kv._replace(data=torch.randn_like(kv.data)))
    assert _generate(garbage, PROMPT) != expected  # the imported K/V is what attention reads


def test_refusals_and_a_pool_too_small_for_the_whole_prefix():
    prefill = _engine()
    _generate(prefill, PROMPT, SamplingParams(temperature=0.0, max_tokens=1))
    kv = prefill.export_prefix_kv(PROMPT)
    with pytest.raises(ValueError, match="hashes"):
        _engine().import_prefix_kv(kv._replace(token_ids=PROMPT[::-1][:64]))
    with pytest.raises(KVLayoutMismatch):
        _engine(block_size=32).import_prefix_kv(kv)
    with pytest.raises(ValueError, match="not a KV-blocks body"):
        KVBlocks.from_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    small = _engine(num_blocks=2)
    assert small.import_prefix_kv(kv) == 2  # the chain's first 2 blocks: all that fits
    small.block_manager.check_invariants()
    assert len(small.block_manager.cached_blocks(PROMPT)) == 2
    assert len(_engine().export_prefix_kv(PROMPT).hashes) == 0  # nothing cached, nothing sent


def _cache_state(engine) -> tuple:
    """Everything a bad import must leave as it was: the prefix-cache map, block keys and refs, the LRU order."""
    pool = engine.block_manager.pool
    return dict(pool.cached), [(b.key, b.ref_cnt) for b in pool.blocks], list(pool.free_queue)


def _bad_imports(kv: KVBlocks) -> dict[str, KVBlocks]:
    """One of each kind of malformed import a forged or corrupted body can carry."""
    nan, inf = kv.data.clone(), kv.data.clone()
    nan[1, 0, 2, 3, 0, 5] = float("nan")
    inf[0, 1, 3, 0, 1, 0] = float("-inf")
    shapes = {f"dim{d}": kv.data.narrow(d, 0, kv.data.shape[d] - 1) for d in (0, 3, 4, 5)}
    return {"nan": kv._replace(data=nan), "inf": kv._replace(data=inf),
            "dtype": kv._replace(data=kv.data.to(torch.float16)), "int": kv._replace(data=kv.data.to(torch.int32)),
            "fewer blocks than hashes": kv._replace(data=kv.data[:, :, :3]),
            "one K/V plane": kv._replace(data=kv.data[:, :1]),
            **{k: kv._replace(data=v) for k, v in shapes.items()},
            "layout": kv._replace(layout=kv.layout | {"layers": 99}),
            "tokens out of the vocabulary": kv._replace(token_ids=[10 ** 9] * len(kv.token_ids)),
            "hashes of other tokens": kv._replace(hashes=kv.hashes[::-1]),
            "more hashes than tokens": kv._replace(token_ids=kv.token_ids[:40]),
            "another salt": kv._replace(cache_salt="someone else")}


def test_a_bad_import_leaves_the_cache_and_the_output_exactly_as_before():
    prefill = _engine()
    _generate(prefill, PROMPT, SamplingParams(temperature=0.0, max_tokens=1))
    kv = prefill.export_prefix_kv(PROMPT)
    other = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(9)).tolist()
    decode = _engine()
    before_output = _generate(decode, other, rid="before")  # something cached there already
    before = _cache_state(decode)
    for name, bad in _bad_imports(kv).items():
        with pytest.raises(ValueError):  # KVLayoutMismatch is one: the server answers 409 / 400
            decode.import_prefix_kv(bad)
        assert _cache_state(decode) == before, name
    decode.block_manager.check_invariants()
    assert _generate(decode, other, rid="after") == before_output
    assert _generate(decode, PROMPT) == _generate(_engine(), PROMPT)  # nothing of the bad imports is found


def test_a_failed_write_registers_nothing(monkeypatch):
    prefill = _engine()
    _generate(prefill, PROMPT, SamplingParams(temperature=0.0, max_tokens=1))
    kv = prefill.export_prefix_kv(PROMPT)
    decode = _engine()
    cached = dict(decode.block_manager.pool.cached)

    def broken(block_ids, data):
        raise RuntimeError("device write failed")

    monkeypatch.setattr(decode.executor, "write_kv_blocks", broken)
    with pytest.raises(RuntimeError):
        decode.import_prefix_kv(kv)
    assert decode.block_manager.pool.cached == cached  # staged blocks never became findable
    assert decode.block_manager.num_free_blocks == decode.block_manager.num_blocks
    decode.block_manager.check_invariants()


def test_blocks_under_one_salt_are_never_found_under_another():
    salted = SamplingParams(temperature=0.0, max_tokens=1, cache_salt="tenant-a")
    prefill = _engine()
    _generate(prefill, PROMPT, salted)
    assert len(prefill.export_prefix_kv(PROMPT).hashes) == 0  # unsalted: not what tenant-a cached
    assert len(prefill.export_prefix_kv(PROMPT, "tenant-b").hashes) == 0
    kv = KVBlocks.from_bytes(prefill.export_prefix_kv(PROMPT, "tenant-a").to_bytes())
    assert len(kv.hashes) == 4 and kv.cache_salt == "tenant-a"
    decode = _engine()
    assert decode.import_prefix_kv(kv) == 4
    _generate(decode, PROMPT, SamplingParams(temperature=0.0, max_tokens=1, cache_salt="tenant-b"), rid="b")
    assert decode.stats().prefix_cache_hits == 0  # another salt: no hit
    _generate(decode, PROMPT, salted, rid="a")
    assert decode.stats().prefix_cache_hits == 4 * 16
