"""Continuous batching, chunked prefill, prefix caching and preemption never change greedy output."""

from __future__ import annotations

import pytest

from ferrylm import SamplingParams
from tests.conftest import chat_prompt_ids, engine_like, hf_greedy, requires_smollm2, run_to_completion
from tests.model.prompts import LONG_CONTEXT, SIXTEEN_PROMPTS

pytestmark = requires_smollm2

NEW = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts16(llm_fp32):
    return chat_prompt_ids(llm_fp32, SIXTEEN_PROMPTS)


@pytest.fixture(scope="module")
def reference16(hf_reference, prompts16):
    return hf_greedy(hf_reference, prompts16, NEW)


def _submit_all(engine, prompts):
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, GREEDY)


def _as_list(done, n):
    return [done[str(i)] for i in range(n)]


def test_sixteen_together_match_transformers(llm_fp32, prompts16, reference16):
    engine = engine_like(llm_fp32, max_num_batched_tokens=2048)
    _submit_all(engine, prompts16)
    assert _as_list(run_to_completion(engine, check=True), 16) == reference16


def test_staggered_arrivals_match(llm_fp32, prompts16, reference16):
    engine = engine_like(llm_fp32, max_num_batched_tokens=512)
    pending = list(enumerate(prompts16))
    done = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:  # a new request joins every third step, mid-flight
            i, ids = pending.pop(0)
            engine.add_request(str(i), ids, GREEDY)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        engine.scheduler.check_invariants()
        step += 1
    assert _as_list(done, 16) == reference16


def test_each_alone_matches(llm_fp32, prompts16, reference16):
    engine = engine_like(llm_fp32, max_num_batched_tokens=2048)
    for i in (0, 2, 7, 15):  # a representative subset alone (short, CJK, long, long-ish)
        engine.add_request(str(i), prompts16[i], GREEDY)
        assert run_to_completion(engine)[str(i)] == reference16[i]


def test_chunked_prefill_budget_32_matches(llm_fp32, prompts16, reference16):
    engine = engine_like(llm_fp32, max_num_batched_tokens=32, enable_prefix_caching=False)
    _submit_all(engine, prompts16)
    assert _as_list(run_to_completion(engine, check=True), 16) == reference16


def test_preemption_keeps_outputs_identical(llm_fp32, prompts16, reference16):
    # Room for the longest request but far from all at once: forces recompute preemption.
    longest = max(map(len, prompts16)) + NEW
    engine = engine_like(llm_fp32, num_blocks=longest // 16 + 12, max_num_batched_tokens=1024,
                         preemption_mode="recompute")  # swap: tests/model/test_swap_preemption.py
    _submit_all(engine, prompts16)
    assert _as_list(run_to_completion(engine, check=True), 16) == reference16
    assert engine.stats().num_preemptions > 0 and engine.stats().num_swapped_out == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_prefix_cache_hits_give_same_output(llm_fp32):
    tok = llm_fp32.get_tokenizer()
    system = LONG_CONTEXT * 3
    questions = ["What did Gutenberg invent?", "Where was Gutenberg from?", "How fast did presses spread?",
                 "What changed with literacy?"]
    convs = [tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}])
             for q in questions]
    cold = engine_like(llm_fp32, enable_prefix_caching=False)
    for i, ids in enumerate(convs):
        cold.add_request(str(i), ids, GREEDY)
    expected = run_to_completion(cold)
    warm = engine_like(llm_fp32)
    warm.add_request("first", convs[0], GREEDY)
    run_to_completion(warm)
    before = warm.stats()
    for i, ids in enumerate(convs):
        warm.add_request(str(i), ids, GREEDY)
    got = run_to_completion(warm, check=True)
    assert got == expected
    hits = warm.stats().prefix_cache_hits - before.prefix_cache_hits
    shared = len(tok.apply_chat_template([{"role": "system", "content": system}], add_generation_prompt=False))
    assert shared >= 256
    # every request reuses the whole shared system prompt (rounded down to full blocks)
    assert hits >= len(convs) * (shared // 16 * 16 - 16)


def test_shared_prefix_prefills_only_tail(llm_fp32):
    tok = llm_fp32.get_tokenizer()
    prefix = tok.encode(LONG_CONTEXT * 3, add_special_tokens=False)
    assert len(prefix) >= 256
    engine = engine_like(llm_fp32, max_num_batched_tokens=2048)
    engine.add_request("a", prefix + tok.encode(" First question?"), GREEDY)
    run_to_completion(engine)
    b_ids = prefix + tok.encode(" A different tail of the prompt.")
    engine.add_request("b", b_ids, GREEDY)
    seen = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: seen.append(schedule()) or seen[-1]  # record what each step computes
    run_to_completion(engine, check=True)
    (item,) = seen[0].scheduled
    assert item.num_computed_tokens == len(prefix) // 16 * 16
    assert len(item.token_ids) == len(b_ids) - len(prefix) // 16 * 16
    assert engine.stats().prefix_cache_hits >= len(prefix) // 16 * 16


def test_seeded_sampling_independent_of_batch(llm_fp32, prompts16):
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    alone = engine_like(llm_fp32)
    alone.add_request("s", prompts16[1], seeded)
    expected = run_to_completion(alone)["s"]
    crowded = engine_like(llm_fp32)
    for i in (3, 4, 5):
        crowded.add_request(f"o{i}", prompts16[i], SamplingParams(temperature=1.0, max_tokens=24))
    crowded.add_request("s", prompts16[1], seeded)
    assert run_to_completion(crowded)["s"] == expected


def test_abort_mid_flight_frees_everything(llm_fp32, prompts16):
    engine = engine_like(llm_fp32, max_num_batched_tokens=64)
    for i in range(4):
        engine.add_request(str(i), prompts16[7 + i], GREEDY)
    for step in range(6):
        engine.step()
        engine.scheduler.check_invariants()
        if step == 2:
            assert engine.abort("0").outputs[0].finish_reason.value == "abort"  # mid-prefill or decoding
    for i in range(1, 4):
        engine.abort(str(i))
    engine.scheduler.check_invariants()
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_llm_n_logprobs_and_stop(llm_fp32):
    params = SamplingParams(temperature=0.9, n=2, seed=7, max_tokens=12, logprobs=3)
    (out,) = llm_fp32.chat([{"role": "user", "content": "Name a colour."}], params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1]
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids)
        for token, entry in zip(c.token_ids, c.logprobs):
            assert token in entry and len(entry) >= 3 and all(v <= 0 for v in entry.values())
    greedy = llm_fp32.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=20),
                               use_tqdm=False)[0].outputs[0].text
    word = greedy.split()[1]
    stopped = llm_fp32.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=20,
                                                                           stop=[word]), use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason.value == "stop" and stopped.stop_reason == word
    assert stopped.text == greedy[:greedy.index(word)]


def test_stats_report_output_budgets_for_admission(llm_fp32, prompts16):
    """LoadReport: output tokens the waiting and running requests may still generate, and the
    batch size (admission control reads them)."""
    engine = engine_like(llm_fp32, max_num_seqs=2)
    for i, ids in enumerate(prompts16[:3]):
        engine.add_request(str(i), ids, GREEDY)
    s = engine.stats()
    assert (s.num_waiting, s.num_waiting_output_tokens, s.num_running_output_tokens, s.max_num_seqs) == \
        (3, 3 * NEW, 0, 2)
    assert s.num_waiting_certain_output_tokens == 3 * NEW  # GREEDY has ignore_eos
    while engine.stats().num_running < 2 or engine.stats().num_running_output_tokens == 2 * NEW:
        engine.step()
    s = engine.stats()
    generated = 2 * NEW - s.num_running_output_tokens
    assert s.num_waiting == 1 and s.num_waiting_output_tokens == NEW and generated >= 1
    run_to_completion(engine)
    s = engine.stats()
    assert (s.num_waiting_output_tokens, s.num_running_output_tokens) == (0, 0)
