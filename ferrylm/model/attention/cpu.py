"""CPU backend: C++ paged decode kernel for single-token queries, torch-native for prefill chunks."""

from __future__ import annotations

import torch

from ferrylm.model.attention.torch_native import TorchNativeBackend, write_kv
from ferrylm.model.forward_batch import ForwardBatch


class CpuBackend:
    """Decode rows read K/V in place through the block table (no gather copy); prefill rows batch
    their matmuls in plain torch, where the GEMM already runs near the machine's peak."""

    def __init__(self, kernels):
        self.kernels = kernels
        self.fallback = TorchNativeBackend()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, batch: ForwardBatch, scale: float) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        if batch.is_decode_only:
            return self.kernels.paged_decode_attention(q.contiguous(), k_cache, v_cache, batch.block_tables,
                                                       batch.seq_lens, scale)
        out = torch.empty_like(q)
        starts = batch.query_start_loc.tolist()
        decode_rows = [b for b, n in enumerate(batch.query_lens_list) if n == 1]
        if decode_rows:
            rows = torch.tensor(decode_rows, dtype=torch.int64)
            token_idx = batch.query_start_loc.index_select(0, rows)
            o = self.kernels.paged_decode_attention(
                q.index_select(0, token_idx).contiguous(), k_cache, v_cache,
                batch.block_tables.index_select(0, rows), batch.seq_lens.index_select(0, rows), scale)
            out.index_copy_(0, token_idx, o)
        for b, n in enumerate(batch.query_lens_list):
            if n > 1:
                s = starts[b]
                out[s:s + n] = self.fallback.prefill(q[s:s + n], k_cache, v_cache, batch.block_tables[b],
                                                      batch.seq_lens_list[b], scale)
        return out


def make_attention_backend(device: torch.device):
    """The fastest backend available for `device` (torch-native where nothing better loads)."""
    kernels = cpu_fused_ops(device)
    return CpuBackend(kernels) if kernels is not None else TorchNativeBackend()


def cpu_fused_ops(device: torch.device):
    """The compiled CPU extension when running on CPU and it builds; else None (plain torch)."""
    if device.type != "cpu":
        return None
    from ferrylm.model.attention.cpu_kernels import load_cpu_kernels

    return load_cpu_kernels()
