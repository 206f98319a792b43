"""The engine's batch-composition counters (what /dashboard draws as prefill vs decode tokens per
step), on the real model: every prompt token not found in the prefix cache is counted as prefill
once, every generated token after the first as decode once, one step per model run."""

from __future__ import annotations

from ferrylm.sampling_params import SamplingParams


def test_prefill_and_decode_tokens_are_counted_once_each(llm_fp32):
    engine = llm_fp32.engine
    before = engine.stats()
    prompts = ["A ferry crosses the fjord at", "Seven gulls followed the boat because"]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = llm_fp32.generate(prompts, params)
    after = engine.stats()
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    assert after.prefill_tokens_total - before.prefill_tokens_total == prompt_tokens - hits
    assert after.decode_tokens_total - before.decode_tokens_total == len(prompts) * (6 - 1)
    steps = after.num_steps_total - before.num_steps_total
    assert 6 <= steps <= 2 * 6  # batched: about one step per generated token
