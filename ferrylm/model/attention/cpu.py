"""CPU backend: C++ paged decode kernel for single-token queries, torch-native for prefill chunks.

Sliding-window layers pass their window to both: the kernel starts each sequence's key loop at
its last `window` keys; prefill chunks read only the blocks from the first key in any query's window.

A quantized KV cache (fp8 / int8, kv_quant.py) is written by a C++ op (a torch op, so the
compiled decode step traces through it) and read in place by the decode kernel; prefill chunks
gather and dequantize it in torch."""

from __future__ import annotations

import torch

from ferrylm.model.attention import kv_quant
from ferrylm.model.attention.base import attn_metadata
from ferrylm.model.attention.cpu_kernels import CpuKernels
from ferrylm.model.attention.metadata import DecodeRows, PagedMetadata, split_batch
from ferrylm.model.attention.torch_native import TorchNativeBackend, write_kv
from ferrylm.model.forward_batch import ForwardBatch


class CpuBackend:
    """Decode rows read K/V in place through the block table (no gather copy); prefill rows batch
    their matmuls in plain torch, where the GEMM already runs near the machine's peak."""

    supports_cuda_graphs = False
    supports_quantized_kv = True  # fp8 / int8 caches (kv_quant.py)
    supports_sliding_window = True

    def __init__(self, kernels: CpuKernels):
        self.kernels = kernels
        self.fallback = TorchNativeBackend()

    def prepare(self, batch: ForwardBatch) -> PagedMetadata:
        return split_batch(batch)

    def prepare_decode(self, batch: ForwardBatch) -> PagedMetadata:
        """prepare() of a batch known to be decode-only, from its tensors alone (no host lists, no
        lengths): what compiled_step.py traces once for every batch size."""
        rows = DecodeRows(batch.query_start_loc[:-1], batch.block_tables, batch.seq_lens, max_seq_len=0)
        return PagedMetadata(decode_only=True, decode=rows, prefill=())

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, batch: ForwardBatch, scale: float, window: int | None = None) -> torch.Tensor:
        meta = attn_metadata(batch, PagedMetadata)
        if kv_quant.is_quantized(k_cache):
            self.kernels.write_kv_quant_(k, v, k_cache, v_cache, batch.slot_mapping)
        else:
            write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        if meta.decode_only:
            return self.kernels.paged_decode_attention(q.contiguous(), k_cache, v_cache, batch.block_tables,
                                                       batch.seq_lens, scale, window or 0)
        out = torch.empty_like(q)
        rows = meta.decode
        if rows is not None:
            o = self.kernels.paged_decode_attention(q.index_select(0, rows.token_idx).contiguous(), k_cache,
                                                    v_cache, rows.block_tables, rows.seq_lens, scale, window or 0)
            out.index_copy_(0, rows.token_idx, o)
        for chunk in meta.prefill:
            s, n = chunk.start, chunk.length
            out[s:s + n] = self.fallback.prefill(q[s:s + n], k_cache, v_cache, chunk.block_table, chunk.seq_len,
                                                  scale, chunk.mask, window, chunk.window_masks)
        return out


def cpu_fused_ops(device: torch.device) -> CpuKernels | None:
    """The C++ CPU ops when running on CPU and they build; else None (plain torch)."""
    if device.type != "cpu":
        return None
    from ferrylm.model.attention.cpu_kernels import load_cpu_kernels

    return load_cpu_kernels()
