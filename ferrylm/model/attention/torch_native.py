"""Plain-torch paged attention: the CPU path and the oracle every kernel is tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ferrylm.model.forward_batch import ForwardBatch


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V rows into their cache slots (block_id * block_size + offset)."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first `length` cached rows, [length, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, batch: ForwardBatch, scale: float) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        out = torch.empty_like(q)
        decode_rows = [b for b, n in enumerate(batch.query_lens_list) if n == 1]
        if decode_rows:
            self._decode(q, k_cache, v_cache, batch, decode_rows, scale, out)
        starts = batch.query_start_loc.tolist() if len(decode_rows) < batch.num_seqs else []
        for b, n in enumerate(batch.query_lens_list):
            if n > 1:
                s = starts[b]
                out[s:s + n] = self.prefill(q[s:s + n], k_cache, v_cache, batch.block_tables[b],
                                             batch.seq_lens_list[b], scale)
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
                rows: list[int], scale: float, out: torch.Tensor) -> None:
        """All single-token queries at once: gather their blocks, mask beyond each length."""
        num_kv_heads, head_dim = k_cache.shape[-2:]
        block_size = k_cache.shape[1]
        rows_t = torch.tensor(rows, dtype=torch.int64, device=q.device)
        token_idx = batch.query_start_loc.index_select(0, rows_t)
        seq_lens = batch.seq_lens.index_select(0, rows_t)
        max_len = max(batch.seq_lens_list[b] for b in rows)
        num_blocks = (max_len + block_size - 1) // block_size
        tables = batch.block_tables.index_select(0, rows_t)[:, :num_blocks]
        keys = k_cache[tables].flatten(1, 2).transpose(1, 2)  # [B, Hkv, S, D]
        values = v_cache[tables].flatten(1, 2).transpose(1, 2)
        qb = q.index_select(0, token_idx)  # [B, H, D]
        qb = qb.view(len(rows), num_kv_heads, -1, head_dim)  # [B, Hkv, G, D]
        positions = torch.arange(keys.shape[2], device=q.device)
        mask = (positions[None, :] < seq_lens[:, None])[:, None, None, :]
        o = _attend(qb, keys, values, mask, scale)  # [B, Hkv, G, D]
        out.index_copy_(0, token_idx, o.reshape(len(rows), -1, head_dim).to(out.dtype))

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                seq_len: int, scale: float) -> torch.Tensor:
        """Causal attention of a chunk of n queries that sit at the end of a seq_len-token sequence.

        torch's SDPA (a blocked flash kernel on CPU) skips fully masked tiles: ~5x faster than
        materialising the [n, seq_len] scores for a 1,000-token prompt. A chunk that starts
        mid-sequence (prefix-cache hit, chunked prefill) gets an offset causal mask.
        """
        n = q.shape[0]
        keys = gather_kv(k_cache, table, seq_len).transpose(0, 1).unsqueeze(0)  # [1, Hkv, S, D]
        values = gather_kv(v_cache, table, seq_len).transpose(0, 1).unsqueeze(0)
        queries = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if n == seq_len:
            o = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:
            q_pos = torch.arange(seq_len - n, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1)  # [n, H, D]
