"""ForwardBatch: the flattened variable-length batch one model forward consumes."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass
class ForwardBatch:
    """Inputs of one forward over B sequences with T new tokens in total.

    Sequence b owns tokens query_start_loc[b]:query_start_loc[b+1] of the flat batch; those are
    its last `query_len` tokens, so its context before this step is seq_lens[b] - query_len.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset, where each new K/V goes
    block_tables: torch.Tensor  # [B, max_blocks] int64 (padding entries are 0, never read)
    seq_lens: torch.Tensor  # [B] int64 total tokens of each sequence after this step
    query_start_loc: torch.Tensor  # [B+1] int64
    logits_indices: torch.Tensor  # [N] int64 rows of the flat batch whose logits are wanted
    # Host copies for control flow (avoid device syncs).
    seq_lens_list: list[int]
    query_lens_list: list[int]
    # What the attention backend's prepare(batch) derived from the fields above, once per step;
    # None until attached (the model then prepares it itself, still once per forward).
    attn_metadata: object | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def is_decode_only(self) -> bool:
        return all(q == 1 for q in self.query_lens_list)

    def with_attn_metadata(self, metadata: object) -> "ForwardBatch":
        """This batch with `metadata` attached (a copy: a batch is never mutated after building)."""
        return replace(self, attn_metadata=metadata)

    @classmethod
    def build(
        cls,
        token_ids: list[list[int]],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        logits_rows: list[int] | None = None,
        device: torch.device | str = "cpu",
    ) -> "ForwardBatch":
        """Build from per-sequence new tokens, tokens already in the cache, and block tables.

        `logits_rows` lists the sequences that need next-token logits (default: all), each taking
        the logits of its last new token.
        """
        query_lens = [len(t) for t in token_ids]
        seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
        flat_ids = [t for seq in token_ids for t in seq]
        positions: list[int] = []
        slots: list[int] = []
        for ctx, q, table in zip(context_lens, query_lens, block_tables):
            for pos in range(ctx, ctx + q):
                positions.append(pos)
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        max_blocks = max((len(t) for t in block_tables), default=0)
        padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        rows = range(len(token_ids)) if logits_rows is None else logits_rows
        logits_indices = [starts[b + 1] - 1 for b in rows]

        def as_tensor(x: list) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=device)

        return cls(
            input_ids=as_tensor(flat_ids),
            positions=as_tensor(positions),
            slot_mapping=as_tensor(slots),
            block_tables=as_tensor(padded).reshape(len(block_tables), max_blocks),
            seq_lens=as_tensor(seq_lens),
            query_start_loc=as_tensor(starts),
            logits_indices=as_tensor(logits_indices),
            seq_lens_list=seq_lens,
            query_lens_list=query_lens,
        )
