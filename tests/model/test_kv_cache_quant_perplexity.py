"""Perplexity of SmolLM2 (bf16) on tests/data/english.txt (2,238 tokens) with the KV cache stored
in fp8 (e4m3, per-tensor scale 1.0) and int8 (a scale per token and KV head): each within +1% of
the same model with a bf16 cache ("auto").

The model is the one tests/model/test_quant_perplexity.py builds (C++ CPU backend); the text is fed
in 1,024-token chunks, and every chunk's attention reads K/V back from the (quantized) paged cache,
its own rows included, so the whole sequence attends to quantized K/V (through the prefill path's
torch dequantize; the C++ decode kernel's reads are checked against it in
tests/unit/test_kv_cache_quant.py). Measured on this machine: auto 28.512, fp8 28.654 (+0.50%),
int8 28.545 (+0.12%). fp8_e5m2 (2 mantissa bits) is accepted but not held to the bound: 29.49
(+3.4%).
"""

from __future__ import annotations

import math

import pytest
import torch

from ferrylm.model.attention import kv_quant
from ferrylm.model.forward_batch import ForwardBatch
from tests.conftest import requires_smollm2
from tests.model.test_quant_perplexity import BLOCK, BOUND, TEXT, _model

pytestmark = requires_smollm2

CHUNK = 1024


@pytest.fixture(scope="module")
def model():
    from ferrylm.model.loader import Checkpoint
    from ferrylm.model.model_source import resolve_model

    return _model(Checkpoint(resolve_model("smollm2-135m")), "none")


@pytest.fixture(scope="module")
def token_ids(model) -> list[int]:
    from ferrylm.model.loader import Checkpoint
    from ferrylm.model.model_source import resolve_model
    from ferrylm.tokenizer import Tokenizer

    checkpoint = Checkpoint(resolve_model("smollm2-135m"))
    ids = Tokenizer.load(checkpoint.source, checkpoint.config.eos_token_ids).encode(TEXT.read_text())
    assert len(ids) >= 2000
    return ids


def perplexity(model, ids: list[int], cache_dtype: str) -> float:
    """exp(mean NLL of each next token), as test_quant_perplexity.perplexity, into caches of `cache_dtype`."""
    cfg = model.config
    blocks = -(-len(ids) // BLOCK)
    dtype = kv_quant.storage_dtype(cache_dtype, torch.bfloat16)
    shape = (blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    caches = [(kv_quant.allocate(shape, dtype, "cpu"), kv_quant.allocate(shape, dtype, "cpu"))
              for _ in range(cfg.num_layers)]
    nll, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, CHUNK):
            piece = ids[start:start + CHUNK]
            batch = ForwardBatch.build([piece], [start], [list(range(blocks))], BLOCK)
            targets = torch.tensor(ids[start + 1:start + 1 + len(piece)])
            logits = model.compute_logits(model(batch, caches)[:len(targets)])
            nll -= torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).sum().item()
            count += len(targets)
    return math.exp(nll / count)


@pytest.fixture(scope="module")
def baseline(model, token_ids) -> float:
    return perplexity(model, token_ids, "auto")


@pytest.mark.parametrize("cache_dtype", ["fp8", "int8"])
def test_kv_cache_perplexity_within_one_percent(model, token_ids, baseline, cache_dtype):
    assert 20 < baseline < 40, baseline
    ppl = perplexity(model, token_ids, cache_dtype)
    assert ppl <= baseline * BOUND, f"--kv-cache-dtype {cache_dtype}: perplexity {ppl:.3f} vs auto {baseline:.3f}"
