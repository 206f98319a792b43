"""--decode-isolation-headroom on the real model: while tenant A's requests decode, tenant B's long
prompt (another cache salt) enters the steps a few tokens at a time, as the learned step cost allows;
every request's greedy tokens equal those of the same requests without isolation, and nothing leaks."""

from __future__ import annotations

from ferrylm.sampling_params import SamplingParams
from tests.conftest import engine_like, requires_smollm2, run_to_completion

pytestmark = requires_smollm2

A_PROMPTS = ["The harbour at dawn", "Three rivers of Europe", "Ferries dock by", "A haiku about tides"]
B_PROMPT = " ".join(["The captain checked the ropes, the charts and the barrels of water."] * 6)


def _run(llm, headroom: float) -> tuple[dict[str, list[int]], list[int]]:
    """(tokens per request, B's prompt tokens in each step that also held A's decode rows)."""
    engine = engine_like(llm, decode_isolation_headroom=headroom, max_num_batched_tokens=256)
    tok = engine.tokenizer
    chunks_beside_a: list[int] = []
    execute = engine.executor.execute

    b_prompt = tok.encode(B_PROMPT)

    def watched(sched):
        items = {s.request_id: s for s in sched.scheduled}
        b = items.get("b")
        if b is not None and b.num_computed_tokens < len(b_prompt) and any(rid.startswith("a") for rid in items):
            chunks_beside_a.append(len(b.token_ids))
        return execute(sched)

    engine.executor.execute = watched
    try:
        for i, text in enumerate(A_PROMPTS):
            engine.add_request(f"a{i}", tok.encode(text), SamplingParams(temperature=0.0, max_tokens=16,
                                                                         ignore_eos=True, cache_salt="tenant-a"))
        for _ in range(3):  # A is decoding (and the step cost has a few samples) before B arrives
            engine.step()
        engine.add_request("b", b_prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                                     cache_salt="tenant-b"))
        done = run_to_completion(engine, check=True)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # cached, unreferenced
    finally:
        engine.executor.execute = execute
    return done, chunks_beside_a


def test_another_tenants_prompt_trickles_in_beside_decodes_with_the_same_tokens(llm_fp32):
    free, free_chunks = _run(llm_fp32, 0.0)
    isolated, chunks = _run(llm_fp32, 0.2)
    assert isolated == free
    assert free_chunks and max(free_chunks) > 50  # without isolation B's prompt came in one chunk
    assert chunks and max(chunks) <= 8, chunks  # with it, a few tokens a step while A decoded
