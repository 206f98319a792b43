"""Host copies of KV blocks for swap preemption: the runner's side of engine/host_pool.py.

Every per-block part of every KV tensor the runner keeps (each layer's K and V, the draft model's
K and V, and an int8 cache's row scales, which live after its codes in the same allocation) gets a
host twin shaped [num_host_blocks, ...]. Swap-out copies device block rows into host rows, swap-in
the other way, one index_select + index_copy_ per part. On CUDA the host tensors are pinned; on CPU
they are still separate tensors, so the accounting and the copy path are really exercised.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ferrylm.model.attention import kv_quant


def block_parts(cache: torch.Tensor) -> list[torch.Tensor]:
    """Views of `cache` with the block index first that together hold all of a block's state: the
    codes as bytes (fp8 has no index_copy_ kernel) and, for int8, the row scales. fp8's single
    per-tensor scale is not per block and never changes, so it is not copied."""
    parts = [cache.view(torch.uint8)]
    if cache.dtype == torch.int8:
        parts.append(kv_quant.scales(cache))
    return parts


def swap_bytes_per_block(caches: Sequence[torch.Tensor]) -> int:
    """Host bytes one block takes across `caches` (what --swap-space is divided by)."""
    return sum(p[0].numel() * p.element_size() for c in caches for p in block_parts(c))


class HostKVSwap:
    """Host twins of `device_caches`' block parts, `num_blocks` blocks each."""

    def __init__(self, device_caches: Sequence[torch.Tensor], num_blocks: int):
        self.device_parts = [p for c in device_caches for p in block_parts(c)]
        self.num_blocks = num_blocks
        pin = any(p.device.type == "cuda" for p in self.device_parts) and num_blocks > 0
        # torch.empty: on CPU the pages are only committed when a swap first writes them
        self.host_parts = [torch.empty((num_blocks, *p.shape[1:]), dtype=p.dtype, pin_memory=pin)
                           for p in self.device_parts]

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy device block → host block for each (device id, host id)."""
        if not pairs:
            return
        dev, host = self._index(pairs)
        for d, h in zip(self.device_parts, self.host_parts):
            h.index_copy_(0, host, d.index_select(0, dev.to(d.device)).cpu())

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy host block → device block for each (host id, device id)."""
        if not pairs:
            return
        host, dev = self._index(pairs)
        for d, h in zip(self.device_parts, self.host_parts):
            d.index_copy_(0, dev.to(d.device), h.index_select(0, host).to(d.device))

    @staticmethod
    def _index(pairs: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        src = torch.tensor([a for a, _ in pairs], dtype=torch.int64)
        dst = torch.tensor([b for _, b in pairs], dtype=torch.int64)
        return src, dst
