"""Fused CPU ops (residual add + RMSNorm, packed RoPE) against the plain-torch layers they replace."""

from __future__ import annotations

import pytest
import torch

from ferrylm.model.arch.layers import RMSNorm, RotaryEmbedding
from ferrylm.model.attention.cpu_kernels import load_cpu_kernels

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="C++ toolchain unavailable; plain torch is used")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_add_rms_norm_matches(dtype, tol, tokens):
    gen = torch.Generator().manual_seed(tokens)
    x, residual = (torch.randn(tokens, 576, generator=gen).to(dtype) for _ in range(2))
    plain = RMSNorm(576, 1e-5).to(dtype)
    plain.weight.uniform_(0.5, 1.5, generator=gen)
    fused = RMSNorm(576, 1e-5, kernels).to(dtype)
    fused.weight.copy_(plain.weight)
    want_out, want_res = plain.forward_residual(x.clone(), residual.clone())
    got_out, got_res = fused.forward_residual(x.clone(), residual.clone())
    assert torch.equal(got_res, want_res)
    assert (got_out.float() - want_out.float()).abs().max().item() <= tol * want_out.float().abs().max().item()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_rope_packed_matches(dtype, tol):
    H, Hkv, D, T = 9, 3, 64, 20
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=gen).to(dtype)
    positions = torch.randint(0, 4000, (T,), generator=gen)
    plain = RotaryEmbedding(D, 4096, 100000.0, None)
    fused = RotaryEmbedding(D, 4096, 100000.0, None, kernels)
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    want_q, want_k = plain(positions, q.reshape(T, H, D), k.reshape(T, Hkv, D))
    packed = qkv.clone()
    assert fused.rotate_packed_(positions, packed, H + Hkv, D)
    got_q, got_k, got_v = packed.split([H * D, Hkv * D, Hkv * D], dim=-1)
    assert torch.equal(got_v, v)  # V is never rotated
    for got, want in ((got_q.reshape(T, H, D), want_q), (got_k.reshape(T, Hkv, D), want_k)):
        assert (got.float() - want.float()).abs().max().item() <= tol * want.float().abs().max().item()
