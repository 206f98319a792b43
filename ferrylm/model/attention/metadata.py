"""PagedMetadata: a batch split into decode rows and prefill chunks, once per step.

The torch-native and CPU backends share it: both attend all single-query rows in one batched call
and each longer chunk on its own. Building it costs host work (lists, small H2D copies, masks)
that is the same for every layer, so `prepare` does it once and the layers only read it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ferrylm.model.forward_batch import ForwardBatch


class DecodeRows(NamedTuple):
    """The sequences with one query this step, gathered from the batch."""

    token_idx: torch.Tensor  # [N] int64 rows of the flat batch (row b is sequence b in a decode-only batch)
    block_tables: torch.Tensor  # [N, max_blocks] int64
    seq_lens: torch.Tensor  # [N] int64
    max_seq_len: int


class PrefillChunk(NamedTuple):
    """Rows start:start+length of the flat batch: the last `length` queries of a seq_len-token sequence."""

    start: int
    length: int
    seq_len: int
    block_table: torch.Tensor  # [max_blocks] int64, this sequence's row of batch.block_tables
    mask: torch.Tensor | None  # [length, seq_len] bool causal mask past the cached context; None: plain causal
    # the step's sliding-window masks of this chunk by window, built by the first sliding layer that needs one
    # and reused by the others (a per-step memo: the metadata is rebuilt every step)
    window_masks: dict[int, torch.Tensor] | None = None


class PagedMetadata(NamedTuple):
    decode_only: bool  # every row is a decode row: decode's tensors are the batch's own
    decode: DecodeRows | None  # None when no row has a single query
    prefill: tuple[PrefillChunk, ...]  # sequences with more than one query, in batch order


def causal_mask(length: int, seq_len: int, device: torch.device) -> torch.Tensor | None:
    """Queries at positions seq_len-length.. see keys up to their own position; None when length == seq_len."""
    if length == seq_len:
        return None
    q_pos = torch.arange(seq_len - length, seq_len, device=device)
    return torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]


def window_start(seq_len: int, length: int, window: int | None) -> int:
    """The first key position any of a chunk's queries sees: its first query's position minus the
    window, plus one (0 without a window or when the window reaches the start)."""
    return 0 if window is None else max(0, seq_len - length - window + 1)


def window_mask(length: int, seq_len: int, first_key: int, window: int, device: torch.device) -> torch.Tensor:
    """[length, seq_len - first_key] bool: query i (position seq_len - length + i) keeps key j
    (position first_key + j) when 0 <= q_pos - k_pos < window (causal, inside the window)."""
    q_pos = torch.arange(seq_len - length, seq_len, device=device)[:, None]
    distance = q_pos - torch.arange(first_key, seq_len, device=device)[None, :]
    return (distance >= 0) & (distance < window)


def _decode_rows(batch: ForwardBatch, rows: list[int]) -> DecodeRows:
    max_len = max(batch.seq_lens_list[b] for b in rows)
    if len(rows) == batch.num_seqs:
        return DecodeRows(batch.query_start_loc[:-1], batch.block_tables, batch.seq_lens, max_len)
    rows_t = torch.tensor(rows, dtype=torch.int64, device=batch.query_start_loc.device)
    return DecodeRows(batch.query_start_loc.index_select(0, rows_t), batch.block_tables.index_select(0, rows_t),
                      batch.seq_lens.index_select(0, rows_t), max_len)


def split_batch(batch: ForwardBatch) -> PagedMetadata:
    """Decode rows and prefill chunks of `batch`, with everything each layer would otherwise rederive."""
    device = batch.query_start_loc.device
    rows = [b for b, n in enumerate(batch.query_lens_list) if n == 1]
    chunks, start = [], 0
    for b, (n, seq_len) in enumerate(zip(batch.query_lens_list, batch.seq_lens_list)):
        if n > 1:
            chunks.append(PrefillChunk(start, n, seq_len, batch.block_tables[b], causal_mask(n, seq_len, device),
                                       {}))
        start += n
    decode = _decode_rows(batch, rows) if rows else None
    return PagedMetadata(len(rows) == batch.num_seqs, decode, tuple(chunks))
