"""Scheduler with a fake runner (no model): budgets, priorities, preemption, aborts, invariants."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferrylm.config import SchedulerConfig
from ferrylm.engine.block_manager import BlockManager
from ferrylm.engine.request import Request
from ferrylm.engine.scheduler import RequestRejected, Scheduler
from ferrylm.outputs import FinishReason
from ferrylm.sampling_params import SamplingParams
from tests.conftest import examples

BS = 4


def make(num_blocks=32, budget=16, max_seqs=8, max_len=128, prefix=True):
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget),
                     BlockManager(num_blocks, BS, prefix), max_len)


def req(rid, n_prompt=6, max_tokens=4, priority=0, t=0.0, eos=(), first=1):
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return Request(rid, list(range(first, first + n_prompt)), params, max_tokens, t, priority, eos)


def step(s: Scheduler, token=7):
    out = s.schedule()
    sampled = {item.request_id: token for item in out.scheduled if item.sample}
    s.update(out, sampled)
    s.check_invariants()
    return out


def test_budget_and_chunked_prefill():
    s = make(budget=8)
    s.add_request(req("a", n_prompt=20))
    out = step(s)
    assert out.num_batched_tokens == 8 and not out.scheduled[0].sample
    step(s)
    out = step(s)  # 4 remaining prompt tokens → sample
    assert len(out.scheduled[0].token_ids) == 4 and out.scheduled[0].sample


def test_decode_and_prefill_share_a_step():
    s = make(budget=10)
    s.add_request(req("a", n_prompt=4))
    step(s)
    s.add_request(req("b", n_prompt=30, t=1.0))
    out = step(s)
    sizes = {i.request_id: len(i.token_ids) for i in out.scheduled}
    assert sizes == {"a": 1, "b": 9}


def test_priority_orders_waiting_queue():
    s = make(budget=6, max_seqs=1)
    s.add_request(req("low", priority=5, t=0.0))
    s.add_request(req("high", priority=0, t=1.0))
    out = step(s)
    assert [i.request_id for i in out.scheduled] == ["high"]


def test_finish_on_length_and_eos():
    s = make()
    s.add_request(req("a", max_tokens=3))
    s.add_request(req("b", max_tokens=10, eos=(7,)))
    for _ in range(5):
        step(s)
    assert not s.has_unfinished
    assert s.block_manager.num_free_blocks == 32


def test_rejects_requests_that_can_never_fit():
    s = make(num_blocks=4, max_len=64)
    with pytest.raises(RequestRejected, match="maximum context length is 64"):
        s.add_request(req("long", n_prompt=60, max_tokens=10))
    with pytest.raises(RequestRejected, match="whole pool"):
        s.add_request(req("big", n_prompt=20, max_tokens=10))
    assert not s.has_unfinished


def test_preempts_lowest_priority_latest_and_requeues_front():
    s = make(num_blocks=6, budget=64)
    s.add_request(req("a", n_prompt=7, max_tokens=9, t=0.0))
    s.add_request(req("b", n_prompt=7, max_tokens=9, t=1.0))
    s.add_request(req("c", n_prompt=7, max_tokens=9, t=2.0, priority=-1))
    while s.has_unfinished:
        step(s)
    assert s.num_preemptions > 0
    assert s.block_manager.num_free_blocks == 6


def test_abort_frees_blocks_anywhere():
    s = make(budget=4)
    s.add_request(req("a", n_prompt=12))
    s.add_request(req("b", n_prompt=12, t=1.0))
    step(s)
    s.finish_request("a", FinishReason.ABORT)
    s.finish_request("b", FinishReason.ABORT)
    s.check_invariants()
    assert s.block_manager.num_free_blocks == 32 and not s.has_unfinished
    assert step(s).scheduled == []


actions = st.lists(st.tuples(st.sampled_from(["add", "step", "step", "abort"]), st.integers(0, 9),
                             st.integers(1, 30), st.integers(1, 12), st.integers(-1, 2)), max_size=80)


def _run_ops(s: Scheduler, ops, step_fn) -> None:
    """Apply hypothesis' add / abort / step actions, checking the invariants after each."""
    ids = 0
    for action, pick, n_prompt, max_tokens, priority in ops:
        if action == "add":
            try:
                s.add_request(req(f"r{ids}", n_prompt, max_tokens, priority, float(ids), eos=(3,),
                                  first=pick % 3))
            except RequestRejected:
                pass
            ids += 1
        elif action == "abort" and s.requests:
            s.finish_request(sorted(s.requests)[pick % len(s.requests)], FinishReason.ABORT)
        else:
            step_fn()
        s.check_invariants()


@settings(max_examples=examples(120), deadline=None)
@given(actions, st.integers(8, 40), st.booleans())
def test_random_add_step_abort_sequences(ops, num_blocks, prefix):
    s = make(num_blocks=num_blocks, budget=12, max_seqs=4, prefix=prefix)
    rng = random.Random(0)

    def random_step() -> None:
        out = s.schedule()
        s.update(out, {i.request_id: rng.randrange(2, 20) for i in out.scheduled if i.sample})

    _run_ops(s, ops, random_step)
    for _ in range(2000):  # everything left must drain: no request is stuck forever
        if not s.has_unfinished:
            break
        step(s, token=9)
    assert not s.has_unfinished
    assert s.block_manager.num_free_blocks == num_blocks


def _speculative_step(s: Scheduler, rng: random.Random) -> None:
    """A fake runner that drafts: each sampled row keeps a random prefix of its draft plus one
    token, and proposes up to 4 tokens for the next step."""
    out = s.schedule()
    sampled, accepted, drafts = {}, {}, {}
    for item in out.scheduled:
        assert len(item.token_ids) >= 1 + len(item.draft_token_ids)
        if not item.sample:
            continue
        assert list(item.token_ids[len(item.token_ids) - len(item.draft_token_ids):]) == list(item.draft_token_ids)
        accepted[item.request_id] = list(item.draft_token_ids[:rng.randint(0, len(item.draft_token_ids))])
        sampled[item.request_id] = rng.randrange(2, 20)
        drafts[item.request_id] = [rng.randrange(2, 20) for _ in range(rng.randint(0, 4))]
    s.update(out, sampled, accepted, drafts)
    for item in out.scheduled:
        r = s.requests.get(item.request_id)
        if r is not None and item.draft_token_ids:
            # KV slots of rejected draft tokens went back: the table covers only computed tokens
            have = len(s.block_manager.block_table(r.request_id))
            assert have == s.block_manager.blocks_needed(r.num_computed_tokens), (have, r.num_computed_tokens)
            assert r.num_tokens == r.num_computed_tokens + 1
        if r is not None:
            assert r.num_output_tokens <= r.max_tokens and r.num_tokens <= s.max_model_len


@settings(max_examples=examples(120), deadline=None)
@given(actions, st.integers(8, 40), st.booleans(), st.integers(0, 2**16))
def test_random_add_step_abort_with_speculative_drafts(ops, num_blocks, prefix, seed):
    """Drafts scheduled in the budget, accepted in part, their slots trimmed: the block accounting
    holds after every step, nothing passes max_tokens, and everything drains with no block lost."""
    s = make(num_blocks=num_blocks, budget=12, max_seqs=4, prefix=prefix, max_len=40)
    rng = random.Random(seed)
    _run_ops(s, ops, lambda: _speculative_step(s, rng))
    for _ in range(2000):
        if not s.has_unfinished:
            break
        _speculative_step(s, rng)
        s.check_invariants()
    assert not s.has_unfinished
    assert s.block_manager.num_free_blocks == num_blocks
    assert s.spec.num_accepted_tokens <= s.spec.num_draft_tokens


def test_draft_scheduling_acceptance_trim_and_stops():
    s = make(num_blocks=32, budget=16)
    s.add_request(req("a", n_prompt=6, max_tokens=6, eos=(3,)))
    out = s.schedule()
    s.update(out, {"a": 7}, {}, {"a": [8, 9, 10, 11]})
    out = s.schedule()
    (item,) = out.scheduled
    assert item.token_ids == [7, 8, 9, 10, 11] and item.draft_token_ids == (8, 9, 10, 11)
    assert out.num_batched_tokens == 5
    s.update(out, {"a": 12}, {"a": [8, 9]}, {"a": [13, 14, 15, 16]})
    r = s.requests["a"]
    assert r.output_token_ids == [7, 8, 9, 12] and r.num_new_tokens == 3
    assert r.num_computed_tokens == 9 and len(s.block_manager.block_table("a")) == 3  # 12 slots → 9 kept
    assert s.spec.num_drafts == 1 and s.spec.accepted_per_pos == [1, 1, 0, 0]
    out = s.schedule()  # 2 output tokens left: a draft of 1 (+ the target's own token)
    assert out.scheduled[0].draft_token_ids == (13,)
    a = s.requests["a"]
    s.update(out, {"a": 20}, {"a": [13]}, {"a": [3, 5]})
    assert "a" not in s.requests and a.output_token_ids == [7, 8, 9, 12, 13, 20]  # max_tokens exactly
    assert a.finish_reason == FinishReason.LENGTH
    s.check_invariants()
    assert s.block_manager.num_free_blocks == 32

    s.add_request(req("b", n_prompt=6, max_tokens=20, eos=(3,)))
    out = s.schedule()
    s.update(out, {"b": 7}, {}, {"b": [3, 5, 6]})
    out = s.schedule()
    holder = s.requests["b"]
    s.update(out, {"b": 9}, {"b": [3, 5]})  # EOS accepted mid-draft: nothing after it
    assert holder.output_token_ids == [7, 3] and holder.finish_reason == FinishReason.STOP
    assert s.block_manager.num_free_blocks == 32


def test_same_prompt_is_prefilled_once():
    """n > 1 siblings (or a retry) of a prompt longer than one step's budget: the first computes
    it; the budget keeps the others waiting until its last chunk, whose step registers every full
    block, so they find all of them cached and the prompt is prefilled once."""
    s = make(num_blocks=64, budget=8)
    reqs = {rid: req(rid, n_prompt=22, max_tokens=2) for rid in ("a", "b", "c")}
    for r in reqs.values():
        s.add_request(r)
    computed = {"a": 0, "b": 0, "c": 0}
    for _ in range(12):
        for item in step(s).scheduled:
            computed[item.request_id] += len(item.token_ids)
    assert computed["a"] == 22 + 1  # its prompt, then one decode
    assert computed["b"] < 8 and computed["c"] < 8  # the tail past the last full block, and a decode
    assert reqs["b"].num_cached_tokens == 20 and reqs["c"].num_cached_tokens == 20
    assert all(r.is_finished for r in reqs.values())



def test_long_prefill_token_threshold_caps_each_requests_chunk():
    """vLLM's --long-prefill-token-threshold: a prompt advances at most that many tokens a step, so
    a running decode shares every step with a small chunk rather than one budget-sized one."""
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, long_prefill_token_threshold=8),
                  BlockManager(64, BS, True), 128)
    s.add_request(req("a", n_prompt=4, max_tokens=20))
    step(s)
    s.add_request(req("b", n_prompt=30, t=1.0, first=40))
    sizes = []
    for _ in range(4):
        sizes.append({i.request_id: len(i.token_ids) for i in step(s).scheduled})
    assert sizes == [{"a": 1, "b": 8}, {"a": 1, "b": 8}, {"a": 1, "b": 8}, {"a": 1, "b": 6}]


def _salted(rid, salt, n_prompt, max_tokens=40, t=0.0, first=1):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, cache_salt=salt)
    return Request(rid, list(range(first, first + n_prompt)), params, max_tokens, t, 0, ())


def _isolating(headroom: float) -> Scheduler:
    s = Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, decode_isolation_headroom=headroom),
                  BlockManager(256, BS, True), 512)
    for tokens, seconds in [(4, 0.017), (12, 0.034), (20, 0.051), (4, 0.017)]:  # 9 ms + 2 ms a token
        s.observe_step(tokens, seconds)
    return s


def test_decode_isolation_caps_another_tenants_prompt_beside_decodes():
    """--decode-isolation-headroom: tenant A's 4 requests decode; tenant B's 60-token prompt may add
    only what 20% of the step buys (0.2 x 17 ms / 2 ms a token: 1 token) while A decodes, and goes at
    full speed once A is done. A's own new prompt is not capped by A's decodes."""
    s = _isolating(0.2)
    for i in range(4):
        s.add_request(_salted(f"a{i}", "tenant-a", 4, max_tokens=6, first=100 * i + 1))
    step(s)
    s.add_request(_salted("b", "tenant-b", 60, t=1.0, first=900))
    s.add_request(_salted("a-new", "tenant-a", 30, t=2.0, first=700))
    first = {i.request_id: len(i.token_ids) for i in step(s).scheduled}
    assert first == {"a0": 1, "a1": 1, "a2": 1, "a3": 1, "b": 1, "a-new": 30}
    sizes = []
    for _ in range(6):
        sizes.append({i.request_id: len(i.token_ids) for i in step(s).scheduled}.get("b"))
    assert sizes[:4] == [1, 1, 1, 1]  # A (a0-a3 and a-new) still decoding
    # the fitted line: 8.5 ms + 2.1 ms a token; 4 decode rows: 17 ms; 200% of it buys 16 tokens
    assert int(2.0 * s.step_cost.step_seconds(4) / s.step_cost.token_seconds()) == 16


def test_decode_isolation_off_or_one_tenant_leaves_prompts_uncapped():
    for headroom, salt_b in [(0.0, "tenant-b"), (0.2, "tenant-a")]:
        s = _isolating(headroom)
        for i in range(4):
            s.add_request(_salted(f"a{i}", "tenant-a", 4, first=100 * i + 1))
        step(s)
        s.add_request(_salted("b", salt_b, 60, t=1.0, first=900))
        assert {i.request_id: len(i.token_ids) for i in step(s).scheduled}["b"] == 60


def test_decode_isolation_lets_a_tenant_run_free_once_the_others_stop_decoding():
    s = _isolating(0.2)
    s.add_request(_salted("a", "tenant-a", 4, max_tokens=3))
    step(s)
    s.add_request(_salted("b", "tenant-b", 60, t=1.0, first=900))
    sizes = [{i.request_id: len(i.token_ids) for i in step(s).scheduled}.get("b") for _ in range(4)]
    assert sizes[0] == 1 and sizes[-1] is not None and sum(x or 0 for x in sizes) > 10, sizes


def test_step_cost_line_is_learned_from_steps():
    from ferrylm.engine.step_cost import StepCostModel

    model = StepCostModel()
    assert model.step_seconds(4) is None and model.token_seconds() is None
    model.observe(4, 0.02)
    # one token count: all of it charged to the tokens
    assert (model.step_seconds(0), model.token_seconds()) == (0.0, 0.005)
    for tokens in (4, 8, 16, 32, 64):
        model.observe(tokens, 0.010 + 0.001 * tokens)
    fixed, per_token = model.step_seconds(0), model.token_seconds()
    assert 0.005 < fixed < 0.015 and 0.0008 < per_token < 0.0012


def test_step_cost_learns_what_a_scored_prompt_token_costs():
    """A prompt token scored for prompt_logprobs also runs the LM head: its cost is learned from steps
    that had some (beyond the plain line), and taken at twice a plain token's before any was seen."""
    from ferrylm.engine.step_cost import SCORED_PRIOR, StepCostModel

    model = StepCostModel()
    for tokens in (4, 8, 16, 4, 8, 16):
        model.observe(tokens, 0.010 + 0.002 * tokens)
    assert abs(model.token_seconds() - 0.002) < 1e-6
    assert abs(model.token_seconds(scored=True) - SCORED_PRIOR * 0.002) < 1e-6
    for _ in range(3):  # 4 decode rows + 2 scored prompt tokens at 6 ms each
        model.observe(6, 0.010 + 0.002 * 4 + 0.006 * 2, scored=2)
    assert abs(model.token_seconds(scored=True) - 0.006) < 1e-6
    assert abs(model.step_seconds(4) - 0.018) < 1e-6  # the decode-only line is unchanged by them
    # half of a 4-row step buys 4 plain prompt tokens, 1 scored one
    assert int(0.5 * model.step_seconds(4) / model.token_seconds()) == 4
    assert int(0.5 * model.step_seconds(4) / model.token_seconds(scored=True)) == 1


def test_decode_isolation_charges_a_scoring_prompt_its_own_cost():
    """Beside tenant A's 4 decode rows (17 ms), half the step (8.5 ms) buys tenant B 4 plain prompt
    tokens (2 ms each) but only 2 scored ones (4 ms each: twice a plain one, before scored steps were
    seen) and 1 once scored steps showed them at 7 ms."""
    def b_chunk(prompt_logprobs, scored_steps=()):
        s = _isolating(0.5)
        for tokens, scored, seconds in scored_steps:
            s.observe_step(tokens, seconds, scored)
        for i in range(4):
            s.add_request(_salted(f"a{i}", "tenant-a", 4, first=100 * i + 1))
        step(s)
        params = SamplingParams(temperature=0, max_tokens=1, cache_salt="tenant-b", prompt_logprobs=prompt_logprobs)
        s.add_request(Request("b", list(range(900, 960)), params, 1, 1.0, 0, ()))
        return {i.request_id: len(i.token_ids) for i in step(s).scheduled}["b"]

    assert b_chunk(None) == 4
    assert b_chunk(1) == 2
    assert b_chunk(1, [(6, 2, 0.017 + 0.014)] * 3) == 1


def test_decode_isolation_caps_last_prompt_tokens_too():
    """A request whose prompt has one token left is still prefilling (n samples of one cached prompt
    each compute their last prompt token): beside tenant A's decodes, tenant B's 8 such requests
    enter under the headroom (1 token a step here), not as 8 extra rows at once."""
    s = _isolating(0.2)
    for i in range(4):
        s.add_request(_salted(f"a{i}", "tenant-a", 4, max_tokens=20, first=100 * i + 1))
    step(s)
    for j in range(8):
        s.add_request(_salted(f"b{j}", "tenant-b", 1, max_tokens=1, t=1.0 + j, first=900 + j))
    b_rows = [sum(1 for i in step(s).scheduled if i.request_id.startswith("b")) for _ in range(3)]
    assert b_rows == [1, 1, 1]
