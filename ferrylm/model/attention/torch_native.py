"""Plain-torch paged attention: the CPU path and the oracle every kernel is tested against.

A quantized cache (fp8 / int8, kv_quant.py) is quantized as rows are written and dequantized to
the query's dtype as blocks are read, so attention itself always runs in the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ferrylm.model.attention import kv_quant
from ferrylm.model.attention.base import attn_metadata
from ferrylm.model.attention.metadata import DecodeRows, PagedMetadata, split_batch, window_mask, window_start
from ferrylm.model.forward_batch import ForwardBatch


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V rows into their cache slots (block_id * block_size + offset)."""
    if kv_quant.is_quantized(k_cache):
        kv_quant.write(k, k_cache, slot_mapping)
        kv_quant.write(v, v_cache, slot_mapping)
        return
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def read_blocks(cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache[blocks] ([*blocks.shape, block_size, Hkv, D]), dequantized to `dtype` if quantized."""
    return kv_quant.read_blocks(cache, blocks, dtype) if kv_quant.is_quantized(cache) else cache[blocks]


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """One sequence's first `length` cached rows, [length, Hkv, D]; a quantized cache's dequantized
    to `dtype` (required then: the model's dtype)."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    if kv_quant.is_quantized(cache):
        if dtype is None:
            raise ValueError("gather_kv of a quantized KV cache needs the dtype to dequantize to")
        return kv_quant.read_blocks(cache, block_table[:num_blocks], dtype).flatten(0, 1)[:length]
    rows = cache.index_select(0, block_table[:num_blocks]).flatten(0, 1)
    return rows[:length]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Grouped-query attention with batched matmuls; the query group of a KV head acts as rows.

    q: [B, Hkv, G*Q, D]; k, v: [B, Hkv, S, D]; mask: bool, broadcastable to [B, 1, G*Q, S], True = keep.
    Scores and softmax in float32.
    """
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v)


class TorchNativeBackend:
    """Decodes are attended together in one batched call; each prefill chunk on its own."""

    supports_cuda_graphs = False
    supports_quantized_kv = True  # fp8 / int8 caches (kv_quant.py)
    supports_sliding_window = True

    def prepare(self, batch: ForwardBatch) -> PagedMetadata:
        return split_batch(batch)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, batch: ForwardBatch, scale: float, window: int | None = None) -> torch.Tensor:
        meta = attn_metadata(batch, PagedMetadata)
        write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        out = torch.empty_like(q)
        if meta.decode is not None:
            self._decode(q, k_cache, v_cache, meta.decode, scale, out, window)
        for chunk in meta.prefill:
            s, n = chunk.start, chunk.length
            out[s:s + n] = self.prefill(q[s:s + n], k_cache, v_cache, chunk.block_table, chunk.seq_len, scale,
                                        chunk.mask, window, chunk.window_masks)
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: DecodeRows,
                scale: float, out: torch.Tensor, window: int | None = None) -> None:
        """All single-token queries at once: gather their blocks, mask beyond each length (and, with
        a window, keys `window` or more positions behind the query)."""
        num_kv_heads, head_dim = k_cache.shape[-2:]
        block_size = k_cache.shape[1]
        num_rows = rows.token_idx.shape[0]
        num_blocks = (rows.max_seq_len + block_size - 1) // block_size
        tables = rows.block_tables[:, :num_blocks]
        keys = read_blocks(k_cache, tables, q.dtype).flatten(1, 2).transpose(1, 2)  # [B, Hkv, S, D]
        values = read_blocks(v_cache, tables, q.dtype).flatten(1, 2).transpose(1, 2)
        qb = q.index_select(0, rows.token_idx)  # [B, H, D]
        qb = qb.view(num_rows, num_kv_heads, -1, head_dim)  # [B, Hkv, G, D]
        positions = torch.arange(keys.shape[2], device=q.device)
        keep = positions[None, :] < rows.seq_lens[:, None]
        if window is not None:
            keep &= positions[None, :] >= rows.seq_lens[:, None] - window
        mask = keep[:, None, None, :]
        o = _attend(qb, keys, values, mask, scale)  # [B, Hkv, G, D]
        out.index_copy_(0, rows.token_idx, o.reshape(num_rows, -1, head_dim).to(out.dtype))

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                seq_len: int, scale: float, mask: torch.Tensor | None, window: int | None = None,
                window_masks: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Causal attention of a chunk of n queries that sit at the end of a seq_len-token sequence.

        torch's SDPA (a blocked flash kernel on CPU) skips fully masked tiles: ~5x faster than
        materialising the [n, seq_len] scores for a 1,000-token prompt. A chunk that starts
        mid-sequence (prefix-cache hit, chunked prefill) gets the offset causal `mask` that
        prepare() built for the step (metadata.causal_mask); None when n == seq_len.
        With a `window` shorter than the context, only the blocks from the first key any query sees
        are read, under a causal window mask, built once a step per window: `window_masks`, the chunk's
        memo (PrefillChunk.window_masks), keeps it for the step's other sliding layers.
        """
        if window is not None and seq_len > window:
            return self._prefill_window(q, k_cache, v_cache, table, seq_len, scale, window, window_masks)
        keys = gather_kv(k_cache, table, seq_len, q.dtype).transpose(0, 1).unsqueeze(0)  # [1, Hkv, S, D]
        values = gather_kv(v_cache, table, seq_len, q.dtype).transpose(0, 1).unsqueeze(0)
        queries = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if mask is None:
            o = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1)  # [n, H, D]

    def _prefill_window(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                        seq_len: int, scale: float, window: int,
                        window_masks: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        n, block_size = q.shape[0], k_cache.shape[1]
        first_block = window_start(seq_len, n, window) // block_size
        first_key = first_block * block_size
        keys = gather_kv(k_cache, table[first_block:], seq_len - first_key, q.dtype).transpose(0, 1).unsqueeze(0)
        values = gather_kv(v_cache, table[first_block:], seq_len - first_key, q.dtype).transpose(0, 1).unsqueeze(0)
        mask = None if window_masks is None else window_masks.get(window)
        if mask is None:
            mask = window_mask(n, seq_len, first_key, window, q.device)
            if window_masks is not None:
                window_masks[window] = mask
        o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys, values, attn_mask=mask, scale=scale,
                                           enable_gqa=True)
        return o[0].transpose(0, 1)  # [n, H, D]
