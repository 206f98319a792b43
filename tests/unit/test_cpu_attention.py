"""The C++ paged decode kernel against its torch-native oracle (fp32 and bf16, GQA, odd lengths,
sliding windows), and the oracle's windows against attention written out per query."""

from __future__ import annotations

import pytest
import torch

from ferrylm.model.attention.cpu import CpuBackend
from ferrylm.model.attention.cpu_kernels import load_cpu_kernels
from ferrylm.model.attention.torch_native import TorchNativeBackend
from ferrylm.model.forward_batch import ForwardBatch

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="C++ toolchain unavailable; torch-native path is used")

BS, HKV, H, D, NB = 16, 3, 9, 64, 96


def _batch(query_lens, context_lens, gen):
    tables, free = [], torch.randperm(NB, generator=gen).tolist()
    for q, c in zip(query_lens, context_lens):
        need = -(-(q + c) // BS)
        tables.append([free.pop() for _ in range(need)])
    tokens = [[1] * q for q in query_lens]
    return ForwardBatch.build(tokens, context_lens, tables, BS)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("query_lens,context_lens", [
    ([1] * 7, [0, 5, 15, 16, 17, 100, 300]),  # decode only, lengths around block edges
    ([1, 40, 1, 3], [63, 0, 200, 30]),  # mixed decode + prefill chunks
])
def test_kernel_matches_torch_native(dtype, tol, query_lens, context_lens):
    _check_against_oracle(dtype, tol, query_lens, context_lens, H, HKV, D)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 1, 128), (16, 4, 32), (5, 5, 64), (6, 2, 80)])
def test_kernel_matches_torch_native_for_other_shapes(dtype, tol, heads, kv_heads, head_dim):
    """Query groups larger than the registers hold (8 heads of 128), MHA, and a head_dim the
    AVX-512 fast path does not take (80: the generic kernel)."""
    _check_against_oracle(dtype, tol, [1] * 6, [0, 7, 16, 33, 150, 290], heads, kv_heads, head_dim)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [1, 7, 16, 40])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 1, 128), (6, 2, 80)])
def test_sliding_window_kernel_matches_torch_native(dtype, tol, window, heads, kv_heads, head_dim):
    """A window shorter, equal to and longer than contexts, inside and across blocks: the fast paths
    (64, 128) and the generic kernel (80); decode rows alone and beside prefill chunks."""
    _check_against_oracle(dtype, tol, [1] * 6, [0, 7, 16, 33, 150, 290], heads, kv_heads, head_dim, window)
    _check_against_oracle(dtype, tol, [1, 40, 1, 3, 20], [63, 0, 200, 30, 5], heads, kv_heads, head_dim, window)


@pytest.mark.parametrize("window", [1, 5, 16, 100])
def test_torch_native_window_equals_attention_per_query(window):
    """Query at position p sees keys p - window + 1 .. p (transformers' sliding_window_overlay)."""
    gen = torch.Generator().manual_seed(1)
    query_lens, context_lens = [1, 30, 1, 4], [40, 0, 3, 50]
    batch = _batch(query_lens, context_lens, gen)
    q, k, v = (torch.randn(sum(query_lens), n, D, generator=gen) for n in (H, HKV, HKV))
    caches = [torch.randn(NB, BS, HKV, D, generator=gen) for _ in range(2)]
    oracle = TorchNativeBackend()
    got = oracle.forward(q, k, v, caches[0], caches[1], batch.with_attn_metadata(oracle.prepare(batch)), D ** -0.5,
                         window=window)
    row = 0
    for b, (n, seq_len) in enumerate(zip(query_lens, batch.seq_lens_list)):
        slots = torch.tensor([batch.block_tables[b, p // BS].item() * BS + p % BS for p in range(seq_len)])
        keys, values = (c.view(-1, HKV, D)[slots].repeat_interleave(H // HKV, dim=1) for c in caches)
        for i in range(n):
            p = seq_len - n + i
            lo = max(0, p - window + 1)
            scores = torch.einsum("hd,khd->hk", q[row], keys[lo:p + 1]) * D ** -0.5
            want = torch.einsum("hk,khd->hd", scores.softmax(-1), values[lo:p + 1])
            torch.testing.assert_close(got[row], want, rtol=1e-5, atol=1e-5)
            row += 1


def _check_against_oracle(dtype, tol, query_lens, context_lens, H, HKV, D, window=None):
    gen = torch.Generator().manual_seed(0)
    batch = _batch(query_lens, context_lens, gen)
    T = sum(query_lens)
    q, k, v = (torch.randn(T, n, D, generator=gen).to(dtype) for n in (H, HKV, HKV))
    caches = [torch.randn(NB, BS, HKV, D, generator=gen).to(dtype) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    backend, oracle = CpuBackend(kernels), TorchNativeBackend()
    got = backend.forward(q, k, v, caches[0], caches[1], batch.with_attn_metadata(backend.prepare(batch)), D ** -0.5,
                          window=window)
    want = oracle.forward(q, k, v, ref_caches[0], ref_caches[1], batch.with_attn_metadata(oracle.prepare(batch)),
                          D ** -0.5, window=window)
    assert torch.equal(caches[0], ref_caches[0]) and torch.equal(caches[1], ref_caches[1])
    err = (got.float() - want.float()).abs().max().item() / max(want.float().abs().max().item(), 1e-6)
    assert err < tol
