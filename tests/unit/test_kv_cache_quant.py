"""Quantized KV cache (--kv-cache-dtype fp8 / int8): write/read round trips within the formats'
error bounds, the C++ writer and decode kernel against the plain-torch oracle on the same caches,
the pool size a fixed kv_cache_memory buys, and a clear error for an unknown dtype."""

from __future__ import annotations

import pytest
import torch

from ferrylm.config import KV_CACHE_DTYPE_CHOICES, CacheConfig, ConfigError, ModelConfig
from ferrylm.model.attention import kv_quant
from ferrylm.model.attention.metadata import DecodeRows
from ferrylm.model.attention.torch_native import TorchNativeBackend, gather_kv, write_kv

QUANTIZED = [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]


def _rows(num_tokens: int, num_kv_heads: int, head_dim: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """K-like rows: mostly ~N(0, 1) with a few outlier channels up to ~20 (SmolLM2's K reaches 21)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    x[..., :2] *= 15.0
    return x.to(dtype)


def _cpu_kernels():
    from ferrylm.model.attention.cpu_kernels import load_cpu_kernels

    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("the C++ CPU kernels do not build here")
    return kernels


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_write_gather_round_trip_within_format_error(dtype):
    """int8: |error| <= half a step (row amax / 127) plus the fp16 scale's rounding; fp8: half an
    ulp of the mantissa (2^-4 e4m3, 2^-3 e5m2) relative, or half the smallest subnormal."""
    blocks, bs, hkv, d = 6, 16, 3, 64
    x = _rows(70, hkv, d, seed=1)
    slots = torch.randperm(blocks * bs, generator=torch.Generator().manual_seed(2))[:70]
    k_cache, v_cache = kv_quant.allocate((blocks, bs, hkv, d), dtype, "cpu"), kv_quant.allocate((blocks, bs, hkv, d),
                                                                                               dtype, "cpu")
    write_kv(x, -x, k_cache, v_cache, slots)
    table = torch.arange(blocks)
    got_k = gather_kv(k_cache, table, blocks * bs, torch.float32)[slots]
    got_v = gather_kv(v_cache, table, blocks * bs, torch.float32)[slots]
    if dtype == torch.int8:
        step = x.abs().amax(-1, keepdim=True) / 127
        bound = step * 0.5 * 1.002 + 1e-6
    else:
        rel = 2.0 ** -4 if dtype == torch.float8_e4m3fn else 2.0 ** -3
        tiny = 2.0 ** -10 if dtype == torch.float8_e4m3fn else 2.0 ** -17
        bound = x.abs() * rel + tiny
    assert ((got_k - x).abs() <= bound).all()
    assert ((got_v + x).abs() <= bound).all()
    untouched = torch.ones(blocks * bs, dtype=torch.bool)
    untouched[slots] = False
    assert (gather_kv(k_cache, table, blocks * bs, torch.float32)[untouched] == 0).all()


def test_fp8_saturates_and_int8_zero_rows():
    cache = kv_quant.allocate((1, 4, 1, 8), torch.float8_e4m3fn, "cpu")
    x = torch.full((2, 1, 8), 1000.0)
    x[1] = -1e6
    kv_quant.write(x, cache, torch.tensor([0, 1]))
    got = gather_kv(cache, torch.tensor([0]), 2, torch.float32)
    assert got[0].eq(448).all() and got[1].eq(-448).all()
    cache8 = kv_quant.allocate((1, 4, 1, 8), torch.int8, "cpu")
    kv_quant.write(torch.zeros(1, 1, 8), cache8, torch.tensor([3]))
    assert gather_kv(cache8, torch.tensor([0]), 4, torch.float32).eq(0).all()


def test_a_clone_without_scales_is_refused():
    cache = kv_quant.allocate((2, 4, 1, 8), torch.int8, "cpu")
    with pytest.raises(ValueError, match="kv_quant.allocate"):
        kv_quant.scales(cache.clone())


@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize("row_dtype", [torch.float32, torch.bfloat16])
def test_cpp_writer_matches_torch(dtype, row_dtype):
    """fp8 codes equal bit for bit; int8 scales equal and codes within one step (x / s is rounded
    where -ffast-math may multiply by 1 / s), nearly all equal."""
    kernels = _cpu_kernels()
    shape = (5, 16, 2, 64)
    x, y = _rows(50, 2, 64, seed=3, dtype=row_dtype), _rows(50, 2, 64, seed=4, dtype=row_dtype)
    slots = torch.randperm(80, generator=torch.Generator().manual_seed(5))[:50]
    ref = [kv_quant.allocate(shape, dtype, "cpu") for _ in range(2)]
    got = [kv_quant.allocate(shape, dtype, "cpu") for _ in range(2)]
    write_kv(x, y, ref[0], ref[1], slots)
    kernels.write_kv_quant_(x, y, got[0], got[1], slots)
    for r, g in zip(ref, got):
        assert torch.equal(kv_quant.scales(r), kv_quant.scales(g))
        if dtype == torch.int8:
            diff = (r.int() - g.int()).abs()
            assert diff.max() <= 1 and diff.ne(0).float().mean() < 0.01
        else:
            assert torch.equal(r.view(torch.uint8), g.view(torch.uint8))


def _oracle_decode(q, k_cache, v_cache, tables, seq_lens, scale):
    out = torch.empty_like(q)
    rows = DecodeRows(torch.arange(q.shape[0]), tables, seq_lens, int(seq_lens.max()))
    TorchNativeBackend()._decode(q, k_cache, v_cache, rows, scale, out)
    return out


@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size", "seed"),
                         [(9, 3, 64, 16, 0), (8, 8, 32, 8, 1), (12, 2, 128, 16, 2), (4, 1, 64, 32, 3),
                          (6, 2, 80, 16, 4)])  # head_dim 80: the generic kernel, not the fast path
def test_cpp_decode_reads_quantized_caches_like_the_oracle(dtype, heads, kv_heads, head_dim, block_size, seed):
    """The decode kernel on fp8 / int8 caches equals the oracle (dequantize, then attend) on the
    same caches: float32 queries within 2e-5, bf16 queries within 2e-2 (the oracle dequantizes to
    bf16, the kernel to fp32). Random lengths and shuffled block tables, GQA and MHA."""
    kernels = _cpu_kernels()
    g = torch.Generator().manual_seed(seed)
    num_blocks, batch = 24, 4
    seq_lens = torch.randint(1, 5 * block_size, (batch,), generator=g)
    max_blocks = -(-int(seq_lens.max()) // block_size)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:max_blocks] for _ in range(batch)])
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = kv_quant.allocate(shape, dtype, "cpu"), kv_quant.allocate(shape, dtype, "cpu")
    slots = torch.arange(num_blocks * block_size)
    write_kv(_rows(len(slots), kv_heads, head_dim, seed + 10), _rows(len(slots), kv_heads, head_dim, seed + 20) / 4,
             k_cache, v_cache, slots)
    scale = head_dim ** -0.5
    for q_dtype, tol in [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)]:
        q = torch.randn(batch, heads, head_dim, generator=g).to(q_dtype)
        got = kernels.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale)
        want = _oracle_decode(q, k_cache, v_cache, tables, seq_lens, scale)
        assert _rel_err(got, want) < tol, (q_dtype, _rel_err(got, want))


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max |difference| over max |want| (as tests/unit/test_cpu_attention.py measures)."""
    return (got.float() - want.float()).abs().max().item() / max(want.float().abs().max().item(), 1e-6)


@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize(("query_lens", "context_lens"), [([1] * 5, [0, 15, 16, 100, 300]),
                                                          ([1, 40, 1, 3], [63, 0, 200, 30])])
def test_cpu_backend_forward_matches_the_oracle(dtype, query_lens, context_lens):
    """The whole CpuBackend step (C++ quantizing write, C++ decode, torch prefill on the dequantized
    cache) against TorchNativeBackend on quantized caches filled the same way, float32 within 1e-3
    of the output's scale (int8 codes may differ by one step where the writers round differently)."""
    from ferrylm.model.attention.cpu import CpuBackend
    from tests.unit.test_cpu_attention import BS, HKV, NB, D, H, _batch

    kernels = _cpu_kernels()
    gen = torch.Generator().manual_seed(0)
    batch = _batch(query_lens, context_lens, gen)
    num_tokens = sum(query_lens)
    q, k, v = (torch.randn(num_tokens, n, D, generator=gen) for n in (H, HKV, HKV))
    history = _rows(NB * BS, HKV, D, seed=9)
    caches, ref = ([kv_quant.allocate((NB, BS, HKV, D), dtype, "cpu") for _ in range(2)] for _ in range(2))
    for pair in (caches, ref):
        write_kv(history, history / 4, pair[0], pair[1], torch.arange(NB * BS))
    backend, oracle = CpuBackend(kernels), TorchNativeBackend()
    got = backend.forward(q, k, v, caches[0], caches[1], batch.with_attn_metadata(backend.prepare(batch)), D ** -0.5)
    want = oracle.forward(q, k, v, ref[0], ref[1], batch.with_attn_metadata(oracle.prepare(batch)), D ** -0.5)
    assert _rel_err(got, want) < 1e-3


def test_bf16_decode_path_unchanged():
    """An auto (bf16) cache still goes through the plain path: equal to the oracle as before."""
    kernels = _cpu_kernels()
    g = torch.Generator().manual_seed(7)
    k_cache = torch.randn(8, 16, 3, 64, generator=g).bfloat16()
    v_cache = torch.randn(8, 16, 3, 64, generator=g).bfloat16()
    q = torch.randn(2, 9, 64, generator=g).bfloat16()
    tables, seq_lens = torch.tensor([[3, 1, 0], [7, 2, 5]]), torch.tensor([40, 33])
    got = kernels.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125)
    assert _rel_err(got, _oracle_decode(q, k_cache, v_cache, tables, seq_lens, 0.125)) < 2e-2


SMOLLM2_SHAPE = ModelConfig("llama", 49152, 576, 1536, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64)


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2", "int8"])
def test_fixed_memory_holds_about_twice_the_blocks(cache_dtype):
    """The same kv_cache_memory: 2x the blocks of bf16 for fp8, 1.94x for int8 (fp16 row scales)."""
    from ferrylm.model.runner import kv_bytes_per_block

    budget = 256 << 20
    auto = budget // kv_bytes_per_block(SMOLLM2_SHAPE, 16, torch.bfloat16)
    quant = budget // kv_bytes_per_block(SMOLLM2_SHAPE, 16, torch.bfloat16, cache_dtype)
    assert quant >= 1.9 * auto, (cache_dtype, quant, auto)


@pytest.mark.parametrize("cache_dtype", KV_CACHE_DTYPE_CHOICES)
def test_allocated_bytes_match_the_budget_per_block(cache_dtype):
    """What allocate() takes is what kv_bytes_per_block() charged (fp8: plus one 4-byte scale)."""
    from ferrylm.model.runner import kv_bytes_per_block

    dtype = kv_quant.storage_dtype(cache_dtype, torch.bfloat16)
    cache = kv_quant.allocate((10, 16, 3, 64), dtype, "cpu")
    per_block = kv_bytes_per_block(ModelConfig("llama", 10, 8, 8, 1, 3, 3, 64), 16, torch.bfloat16, cache_dtype) // 2
    extra = 4 if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else 0
    assert cache.untyped_storage().nbytes() == 10 * per_block + extra


def test_unknown_kv_cache_dtype_is_a_config_error_naming_the_flag():
    with pytest.raises(ConfigError, match="--kv-cache-dtype") as info:
        CacheConfig(cache_dtype="fp4")
    assert "int8" in str(info.value) and "fp8" in str(info.value)


def test_cli_rejects_unknown_kv_cache_dtype(capsys):
    import argparse

    from ferrylm.cli import _add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    _add_engine_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "fp4"])
    assert "--kv-cache-dtype" in capsys.readouterr().err
    config = engine_config_from_args(parser.parse_args(["--kv-cache-dtype", "int8"]))
    assert config.cache.cache_dtype == "int8"
    assert engine_config_from_args(parser.parse_args([])).cache.cache_dtype == "auto"


def test_num_gpu_blocks_override_sizes_the_pool_in_blocks_whatever_the_memory(capsys):
    """vLLM's --num-gpu-blocks-override: a pool size that does not depend on the dtype the CPU picks."""
    import argparse

    from ferrylm.cli import _add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    _add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(["--num-gpu-blocks-override", "160", "--kv-cache-memory", "1"]))
    assert config.cache.num_blocks == 160
    assert engine_config_from_args(parser.parse_args([])).cache.num_blocks is None
    with pytest.raises(ConfigError, match="--num-gpu-blocks-override"):
        engine_config_from_args(parser.parse_args(["--num-gpu-blocks-override", "0"]))
