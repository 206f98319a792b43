"""Every instruction-set variant of the C++ CPU kernels this CPU runs (portable, avx2, avx512_bf16)
against the torch reference and against the portable twin: paged decode attention on fp32, bf16,
fp8 and int8 caches (fast-path head dims 32 / 64 / 128 and the generic kernel's 80; query groups
1, 3, 4 and 7; lengths around block and vector edges), add_rms_norm_ and rope_qkv_ in fp32 and bf16.

Tolerances are tight on purpose, so a wrong path fails: the attention reference is float64 on the
same (dequantized) cache, so an fp32 output is within a few fp32 ulps of the largest value and a
bf16 one within its own rounding; RoPE must equal torch bit for bit and add_rms_norm_'s residual
too (round to nearest even, ties included); its output may move by an ulp or two (the sum of squares
is added in another order, so 1 / rms may differ in its last bit).
"""

from __future__ import annotations

from functools import cache

import pytest
import torch

from ferrylm.model.arch.layers import RMSNorm, RotaryEmbedding
from ferrylm.model.attention import kv_quant
from ferrylm.model.attention.cpu_kernels import load_cpu_kernels
from ferrylm.model.attention.torch_native import gather_kv, write_kv
from ferrylm.model.cpu.cpu_isa import BY_NAME, this_cpu
from tests.unit.test_kv_cache_quant import _rows

VARIANTS = ("portable", "avx2", "avx512_bf16")
CACHES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn,
          "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}
SEQ_LENS = (1, 15, 16, 17, 300)
KV_HEADS = 2
FP32_TOL = 5e-6  # of the output's largest magnitude; seen: up to 1.8e-6 (portable), 1e-6 (avx2, avx512_bf16)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One thread: on a busy 2-core machine OpenMP's waiting threads made this file three times slower.
    test_results_do_not_depend_on_threads covers the kernels' split across threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _kernels(name: str):
    """The variant's ops, or a skip saying why this machine cannot run them."""
    cpu = this_cpu()
    if not cpu.supports(BY_NAME[name]):
        missing = sorted(BY_NAME[name].requires - cpu.flags) or [BY_NAME[name].arch]
        pytest.skip(f"this CPU ({cpu.model or cpu.arch}) lacks {', '.join(missing)} for the {name} kernels")
    kernels = load_cpu_kernels(name)
    if kernels is None:
        pytest.skip("the C++ CPU kernels do not build here")
    return kernels


# ---------------------------------------------------------------- paged decode attention


@cache
def _decode_case(cache_dtype: str, head_dim: int, group: int, block_size: int):
    """Caches filled by the torch writer, shuffled block tables, fp32 and bf16 queries. Cached: every
    variant sees the very same tensors."""
    gen = torch.Generator().manual_seed(head_dim * 100 + group * 10 + block_size)
    need = [-(-s // block_size) for s in SEQ_LENS]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.tensor([[perm.pop() for _ in range(n)] + [0] * (max(need) - n) for n in need])
    shape = (num_blocks, block_size, KV_HEADS, head_dim)
    k_cache, v_cache = (kv_quant.allocate(shape, CACHES[cache_dtype], "cpu") for _ in range(2))
    slots = torch.arange(num_blocks * block_size)
    seed = int(torch.randint(0, 1000, (1,), generator=gen))
    write_kv(_rows(len(slots), KV_HEADS, head_dim, seed), _rows(len(slots), KV_HEADS, head_dim, seed + 1) / 4,
             k_cache, v_cache, slots)
    q = torch.randn(len(SEQ_LENS), group * KV_HEADS, head_dim, generator=gen)
    q_dtypes = [torch.float32, torch.bfloat16] if kv_quant.is_quantized(k_cache) else [CACHES[cache_dtype]]
    return k_cache, v_cache, tables, torch.tensor(SEQ_LENS), [q.to(d) for d in q_dtypes]


def _reference(q, k_cache, v_cache, tables, seq_lens, scale) -> torch.Tensor:
    """float64 attention over the cache's exact (dequantized) values, all sequences at once (padded
    to the longest, masked): [B, H, D]."""
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    t = torch.arange(int(seq_lens.max()))
    slots = tables[:, t // block_size] * block_size + t % block_size  # [B, S]
    every = torch.arange(num_blocks)
    k, v = (gather_kv(c, every, num_blocks * block_size, torch.float32).double()[slots] for c in (k_cache, v_cache))
    qg = q.double().unflatten(1, (kv_heads, -1)) * scale  # [B, Hkv, G, D]: a query group per KV head
    scores = torch.einsum("bkgd,bskd->bkgs", qg, k).masked_fill(t >= seq_lens[:, None, None, None], -torch.inf)
    return torch.einsum("bkgs,bskd->bkgd", scores.softmax(-1), v).flatten(1, 2)


@cache
def _expected(cache_dtype: str, head_dim: int, group: int, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(float64 reference, portable output) per query dtype of a case, computed once for all variants."""
    k_cache, v_cache, tables, seq_lens, queries = _decode_case(cache_dtype, head_dim, group, block_size)
    portable, scale = _kernels("portable"), head_dim ** -0.5
    return [(_reference(q, k_cache, v_cache, tables, seq_lens, scale),
             portable.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale)) for q in queries]


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """fp32: within FP32_TOL of the largest |want|. bf16: each element within its own rounding (half
    a bf16 ulp, 2^-8 relative, plus the fp32 noise before it)."""
    err = (got.double() - want.double()).abs()
    scale = want.abs().max().item()
    if got.dtype == torch.float32:
        assert err.max().item() <= FP32_TOL * scale, (what, err.max().item() / scale)
    else:
        bound = want.double().abs() * 2.0 ** -8 * 1.001 + FP32_TOL * scale
        assert (err <= bound).all(), (what, (err - bound).max().item())


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 3, 4, 7])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 80])  # 80: the generic kernel, not a fast path
@pytest.mark.parametrize("cache_dtype", list(CACHES))
@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_attention_matches_reference_and_portable(variant, cache_dtype, head_dim, group, block_size):
    kernels = _kernels(variant)
    k_cache, v_cache, tables, seq_lens, queries = _decode_case(cache_dtype, head_dim, group, block_size)
    for q, (want, twin) in zip(queries, _expected(cache_dtype, head_dim, group, block_size)):
        got = kernels.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, head_dim ** -0.5)
        _assert_close(got, want, f"{variant} vs float64, q {q.dtype}")
        _assert_same_rounding(got, twin, f"{variant} vs portable, q {q.dtype}")


def _assert_same_rounding(got: torch.Tensor, twin: torch.Tensor, what: str) -> None:
    """Two near-exact fp32 computations: fp32 outputs within FP32_TOL; bf16 outputs equal but for
    a rare element rounded the other way (one ulp, 2^-7 relative, or the fp32 noise of a value that
    nearly cancels to 0)."""
    if got.dtype == torch.float32:
        _assert_close(got, twin.double(), what)
        return
    diff, want = (got.double() - twin.double()).abs(), twin.double().abs()
    assert (diff <= want * 2.0 ** -7 + 2 * FP32_TOL * want.max()).all(), what
    assert diff.ne(0).float().mean().item() < 0.01, what


# ---------------------------------------------------------------- add_rms_norm_ and rope_qkv_


@pytest.mark.parametrize("hidden", [576, 100])  # 100: the vector loops' scalar tail (100 = 12 x 8 + 4)
@pytest.mark.parametrize("tokens", [1, 7, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", VARIANTS)
def test_add_rms_norm_matches_torch_and_portable(variant, dtype, tokens, hidden):
    kernels, portable = _kernels(variant), _kernels("portable")
    gen = torch.Generator().manual_seed(tokens * 1000 + hidden)
    x, residual = (torch.randn(tokens, hidden, generator=gen).to(dtype) for _ in range(2))
    plain = RMSNorm(hidden, 1e-5).to(dtype)
    plain.weight.uniform_(0.5, 1.5, generator=gen)
    want_out, want_res = plain.forward_residual(x.clone(), residual.clone())
    outs = []
    for ops in (kernels, portable):
        got_out, got_res = x.clone(), residual.clone()
        ops.add_rms_norm_(got_out, got_res, plain.weight, 1e-5)
        assert torch.equal(got_res, want_res)  # one rounding of an exact sum: ties to even, as c10
        _assert_within_ulps(got_out, want_out)
        outs.append(got_out)
    _assert_within_ulps(outs[0], outs[1])


def _assert_within_ulps(got: torch.Tensor, want: torch.Tensor) -> None:
    """Where 1 / rms differs in its last bit, an output moves by an ulp or two of its dtype (seen: 2.6
    fp32 ulps relative to the value) or, in bf16, rarely rounds the other way (seen: never)."""
    ulp = 2.0 ** -23 if got.dtype == torch.float32 else 2.0 ** -7
    diff = (got.double() - want.double()).abs()
    assert (diff <= want.double().abs() * 4 * ulp + 1e-30).all(), (diff / want.double().abs()).max().item()
    if got.dtype == torch.bfloat16:
        assert diff.ne(0).float().mean().item() < 0.01


@pytest.mark.parametrize("head_dim", [64, 128, 80, 36])  # 36: half of 18, the vector loop's scalar tail
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", VARIANTS)
def test_rope_equals_torch_bit_for_bit(variant, dtype, head_dim):
    """Each product rounded on its own, then the difference / sum, then one rounding to the dtype,
    exactly as the torch reference: equal, not close (no FMA contraction, ties to even)."""
    kernels = _kernels(variant)
    heads, kv_heads, tokens = 9, 3, 33
    gen = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 4000, (tokens,), generator=gen)
    rope = RotaryEmbedding(head_dim, 4096, 100000.0, None)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    want_q, want_k = rope(positions, q.reshape(tokens, heads, head_dim), k.reshape(tokens, kv_heads, head_dim))
    packed = qkv.clone()
    kernels.rope_qkv_(packed, positions, rope.cos, rope.sin, heads + kv_heads, head_dim)
    got_q, got_k, got_v = packed.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    assert torch.equal(got_q.reshape(want_q.shape), want_q)
    assert torch.equal(got_k.reshape(want_k.shape), want_k)
    assert torch.equal(got_v, v)


@pytest.mark.parametrize("variant", VARIANTS)
def test_results_do_not_depend_on_threads(variant):
    """Every task (sequence and KV head, token row) is computed alike on any thread: equal bits."""
    kernels = _kernels(variant)
    k_cache, v_cache, tables, seq_lens, queries = _decode_case("int8", 64, 3, 16)
    gen = torch.Generator().manual_seed(1)
    x, residual, qkv = (torch.randn(64, 576, generator=gen).bfloat16() for _ in range(3))
    rope = RotaryEmbedding(64, 4096, 100000.0, None)
    positions = torch.randint(0, 4000, (64,), generator=gen)
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            outs = [kernels.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125) for q in queries]
            normed, res, rotated = x.clone(), residual.clone(), qkv.clone()
            kernels.add_rms_norm_(normed, res, torch.ones(576).bfloat16(), 1e-5)
            kernels.rope_qkv_(rotated, positions, rope.cos, rope.sin, 9, 64)
        finally:
            torch.set_num_threads(1)
        results.append([*outs, normed, res, rotated])
    assert all(torch.equal(a, b) for a, b in zip(*results))
