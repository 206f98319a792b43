"""AttentionBackend protocol: write new K/V into the paged cache, then attend over it."""

from __future__ import annotations

from typing import Protocol

import torch

from ferrylm.model.forward_batch import ForwardBatch


class AttentionBackend(Protocol):
    """Paged attention over a flattened varlen batch.

    Caches are [num_blocks, block_size, num_kv_heads, head_dim]; q is [T, H, D], k/v [T, Hkv, D].
    Returns [T, H, D].
    """

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
    ) -> torch.Tensor: ...
