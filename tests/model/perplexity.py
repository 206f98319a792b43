"""Perplexity of a model over a token sequence, fed chunk by chunk into a paged KV cache: the quality
bar of the weight- and KV-quantization tests."""

from __future__ import annotations

import math

import torch

from ferrylm.model.attention import kv_quant
from ferrylm.model.forward_batch import ForwardBatch

BLOCK = 16


def perplexity(model, ids: list[int], chunk: int, cache_dtype: str = "auto",
               model_dtype: torch.dtype = torch.bfloat16) -> float:
    """exp(mean NLL of each next token), the text fed `chunk` tokens per forward into caches of
    --kv-cache-dtype `cache_dtype` (`model_dtype`, the activations', for "auto")."""
    cfg = model.config
    blocks = -(-len(ids) // BLOCK)
    dtype = kv_quant.storage_dtype(cache_dtype, model_dtype)
    shape = (blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    caches = [(kv_quant.allocate(shape, dtype, "cpu"), kv_quant.allocate(shape, dtype, "cpu"))
              for _ in range(cfg.num_layers)]
    nll, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, chunk):
            piece = ids[start:start + chunk]
            batch = ForwardBatch.build([piece], [start], [list(range(blocks))], BLOCK)
            targets = torch.tensor(ids[start + 1:start + 1 + len(piece)])
            logits = model.compute_logits(model(batch, caches)[:len(targets)])
            nll -= torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).sum().item()
            count += len(targets)
    return math.exp(nll / count)
