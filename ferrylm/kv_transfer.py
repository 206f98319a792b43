"""KV blocks moved between engines (disaggregated prefill/decode): the K/V of a prompt's leading full
blocks, named by their chained block hashes, with the cache layout they were written in. A leaf
module: the engine passes the tensor through without importing torch; the runner reads and writes
it; `to_bytes` / `from_bytes` are the wire format (safetensors: the tensor plus JSON metadata)."""

from __future__ import annotations

import json
from typing import Any, NamedTuple


class KVLayoutMismatch(ValueError):
    """The sender's cache layout (model, dtype, block size, heads) is not the receiver's."""


class KVBlocks(NamedTuple):
    layout: dict[str, Any]  # runner.kv_layout(): blocks are only exchangeable between equal layouts
    hashes: list[int]  # block_manager.block_hashes of the prompt's first len(hashes) full blocks
    data: Any  # torch.Tensor [layers, 2 (K, V), blocks, block_size, kv_heads, head_dim], cache storage dtype
    token_ids: list[int]  # the tokens those blocks hold (the receiver checks the hashes against them)
    cache_salt: str | None = None  # the prompt's cache salt: part of the hashes (a tenant's blocks stay its own)

    def to_bytes(self) -> bytes:
        from safetensors.torch import save

        meta = {"layout": json.dumps(self.layout, sort_keys=True), "hashes": json.dumps(self.hashes),
                "tokens": json.dumps(self.token_ids), "cache_salt": json.dumps(self.cache_salt)}
        return save({"kv": self.data.contiguous()}, metadata=meta)

    @classmethod
    def from_bytes(cls, body: bytes) -> "KVBlocks":
        """Raises ValueError on anything that is not a KV-blocks body."""
        from safetensors import SafetensorError
        from safetensors.torch import load

        try:
            tensors = load(body)
            meta = _metadata(body)
            layout, hashes, tokens = (json.loads(meta[k]) for k in ("layout", "hashes", "tokens"))
            salt = json.loads(meta.get("cache_salt", "null"))
        except (SafetensorError, KeyError, json.JSONDecodeError, TypeError, ValueError, RecursionError) as e:
            raise ValueError(f"not a KV-blocks body ({type(e).__name__})") from None
        if not isinstance(layout, dict) or not (salt is None or isinstance(salt, str)):
            raise ValueError("not a KV-blocks body (its layout is not an object, or its cache_salt not a string)")
        if "kv" not in tensors or not isinstance(hashes, list) or tensors["kv"].dim() != 6 \
                or tensors["kv"].shape[2] != len(hashes):
            raise ValueError("not a KV-blocks body (tensor 'kv' [layers, 2, blocks, ...] with one hash per block)")
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens) \
                or not all(type(h) is int for h in hashes):
            raise ValueError("not a KV-blocks body (its tokens or hashes are not lists of integers)")
        return cls(layout, hashes, tensors["kv"], tokens, salt)


def _metadata(body: bytes) -> dict[str, str]:
    """The safetensors header's __metadata__ (safetensors.torch.load drops it)."""
    size = int.from_bytes(body[:8], "little")
    meta = json.loads(body[8:8 + size]).get("__metadata__") or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise TypeError("metadata is not a map of strings")
    return meta
