"""SmolLM2 (GGUF Q4_1) against transformers loading the same file: greedy tokens and logits."""

from __future__ import annotations

import pytest
import torch

from ferrylm import SamplingParams
from tests.conftest import chat_prompt_ids, hf_greedy, requires_smollm2
from tests.model.prompts import CHAT_PROMPTS

pytestmark = requires_smollm2

NEW_TOKENS = 40  # transformers' greedy decode of 9 prompts is most of this file's time


@pytest.fixture(scope="module")
def prompt_ids(llm_fp32):
    return chat_prompt_ids(llm_fp32, CHAT_PROMPTS)


@pytest.fixture(scope="module")
def reference_tokens(hf_reference, prompt_ids):
    return hf_greedy(hf_reference, prompt_ids, NEW_TOKENS)


def test_prompts_cover_short_and_long(prompt_ids):
    assert len(prompt_ids) >= 8
    assert min(map(len, prompt_ids)) < 60 and max(map(len, prompt_ids)) > 450


def test_greedy_tokens_match_transformers(llm_fp32, prompt_ids, reference_tokens):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm_fp32.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, reference_tokens)):
        assert out.outputs[0].token_ids == ref, f"prompt {i} diverged"


def test_last_position_logits_match(llm_fp32, hf_reference, prompt_ids):
    runner = llm_fp32.engine.executor
    from ferrylm.model.forward_batch import ForwardBatch

    for ids in (prompt_ids[0], prompt_ids[7]):
        blocks = list(range(-(-len(ids) // runner.block_size)))
        # A private cache, so the engine's prefix-cached blocks are not overwritten.
        caches = [(torch.zeros((len(blocks),) + k.shape[1:]), torch.zeros((len(blocks),) + k.shape[1:]))
                  for k, _ in runner.kv_caches]
        with torch.inference_mode():
            batch = ForwardBatch.build([ids], [0], [blocks], runner.block_size)
            ours = runner.model.compute_logits(runner.model(batch, caches)[batch.logits_indices])[0]
            ref = hf_reference(torch.tensor([ids])).logits[0, -1]
        assert (ours - ref).abs().max().item() < 1e-3
