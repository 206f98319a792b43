"""On a real GPU: every architecture beyond Llama through `LLM(device="cuda")` (Triton attention, CUDA
graphs on, prefix caching and 16-token chunked prefill) in float32 gives transformers' greedy tokens
on the same random weights (CPU, float32), logprobs within 1e-3.

Gemma 3's sliding-window layers, and Mistral's and Phi-3's with a window, run the Triton kernels'
window path here; MoE models run their expert loop on the GPU. Skipped without CUDA or triton.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.model.tiny_models import add_word_tokenizer, make_tiny_model, transformers_greedy

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
]

TOKENS = 32
SHARED = [5, 9, 33, 70, 41, 18, 27, 64, 12, 90, 101, 7, 55, 38, 29, 77, 150, 3]  # > one 16-token block
KINDS = [("llama3", {}), ("qwen3", {}), ("phi3", {}), ("mixtral", {}), ("qwen3_moe", {}), ("llama4", {}),
         ("gemma3", {}), ("mistral", {"sliding_window": 8}), ("phi3", {"sliding_window": 8})]


@pytest.mark.parametrize("kind,overrides", KINDS, ids=[k + ("-window" if o else "") for k, o in KINDS])
def test_greedy_on_gpu_equals_transformers(kind, overrides, tmp_path):
    import transformers

    from ferrylm import LLM, SamplingParams

    directory = str(add_word_tokenizer(make_tiny_model(kind, tmp_path / kind, **overrides)))
    # Gemma 3's window is 8: prompts of 19-46 tokens plus 32 new ones cross it in prefill and in decode
    prompts = [SHARED + [200 + i] * (1 + 9 * i) for i in range(4)]
    llm = LLM(directory, dtype="float32", device="cuda", max_num_batched_tokens=16, enable_prefix_caching=True,
              max_num_seqs=8, gpu_memory_utilization=0.05)  # pytest -n 4: four engines share the card
    assert type(llm.engine.executor.attn_backend).__name__ == "TritonBackend"
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, logprobs=0)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    outs = first + llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)
    assert all(o.num_cached_tokens >= 16 for o in outs[1:])
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    for prompt, out in zip(prompts, outs):
        want_tokens, want_logprobs = transformers_greedy(reference, prompt, TOKENS)
        got = out.outputs[0]
        assert got.token_ids == want_tokens
        assert max(abs(lp[t] - w) for lp, t, w in zip(got.logprobs, got.token_ids, want_logprobs)) < 1e-3


def test_a_kv_budget_too_small_for_one_sequence_is_an_error_naming_the_flags(tmp_path):
    from ferrylm import LLM
    from ferrylm.config import ConfigError

    directory = str(add_word_tokenizer(make_tiny_model("qwen3", tmp_path / "qwen3")))
    with pytest.raises(ConfigError, match="--gpu-memory-utilization.*--max-model-len"):
        LLM(directory, dtype="float32", device="cuda", gpu_memory_utilization=1e-5)
