"""AttentionBackend protocol: `prepare(batch)` once per step, then `forward` in every layer.

Everything a backend derives from the batch alone (which rows decode, prefill segments, block
tables in its kernels' layout, launch plans) is built by `prepare` into a metadata object that the
runner attaches to the ForwardBatch (`batch.with_attn_metadata(backend.prepare(batch))`); the
layers only read it, so a 30-layer model does that bookkeeping once, not 30 times.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from ferrylm.config import ModelConfig
from ferrylm.model.forward_batch import ForwardBatch

MetadataT = TypeVar("MetadataT")


@dataclass(frozen=True)
class AttentionSpec:
    """What a backend may know before the first batch: the head layout and the KV cache's layout."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def for_model(cls, config: ModelConfig, block_size: int, dtype: torch.dtype,
                  device: torch.device | str) -> "AttentionSpec":
        return cls(config.num_heads, config.num_kv_heads, config.head_dim, block_size, dtype, torch.device(device))


class AttentionBackend(Protocol):
    """Paged attention over a flattened varlen batch.

    Caches are [num_blocks, block_size, num_kv_heads, head_dim]; q is [T, H, D], k/v [T, Hkv, D].
    `forward` returns [T, H, D] and reads the metadata this backend's `prepare` attached to `batch`.
    `supports_cuda_graphs`: `prepare` of a decode-only batch depends on its shapes only, and its
    tensors may be captured once and refilled in place (see cuda_graphs.py).
    `window` (sliding-window layers, when `supports_sliding_window`): a query at position p sees only
    keys at p - window + 1 .. p; older keys stay in the cache, masked. None: the whole context.
    """

    supports_cuda_graphs: bool
    supports_sliding_window: bool

    def prepare(self, batch: ForwardBatch) -> object: ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor: ...


def attn_metadata(batch: ForwardBatch, kind: type[MetadataT]) -> MetadataT:
    """The metadata attached to `batch`, checked to be the kind this backend's prepare() builds."""
    metadata = batch.attn_metadata
    if not isinstance(metadata, kind):
        raise ValueError(f"the batch carries {type(metadata).__name__} attention metadata, this backend needs "
                         f"{kind.__name__}: attach backend.prepare(batch) with batch.with_attn_metadata() first")
    return metadata
