"""Admission control from synthetic engine stats: Little's-law wait projection, tier budgets and
priorities, 429/503 with Retry-After, drain-rate tracking. No engine anywhere."""

from __future__ import annotations

import dataclasses

import pytest

from ferrylm.gateway.admission import AdmissionController, DrainRateTracker
from ferrylm.gateway.config import AdmissionConfig, ConfigError
from ferrylm.http.errors import APIError
from ferrylm.load_report import LoadReport
from tests.gateway.helpers import admit


def report(kv: float = 0.0, **fields) -> LoadReport:
    """A LoadReport of zeros but for `fields`; `kv`: the KV cache usage (of 100 blocks)."""
    return dataclasses.replace(LoadReport.empty(), kv_blocks_used=round(kv * 100), kv_blocks_total=100, **fields)


SATURATED = report(num_waiting=100, num_running=64, num_waiting_prompt_tokens=50_000, kv=0.99)
IDLE = report(num_waiting=0, num_running=3, num_waiting_prompt_tokens=0, kv=0.2)


def stats(waiting=0, running=0, waiting_tokens=0, kv=0.0, prompt_total=0, generated_total=0, **extra):
    """An engine's snapshot, as the server hands it to the gateway."""
    return report(kv, num_waiting=waiting, num_running=running, num_waiting_prompt_tokens=waiting_tokens,
                  prompt_tokens_total=prompt_total, generation_tokens_total=generated_total, **extra)


@pytest.fixture
def controller() -> AdmissionController:
    return AdmissionController(AdmissionConfig())


def test_saturated_is_shed_with_retry_after(controller):
    d = controller.decide(SATURATED, "standard", drain_rate=1000.0, mean_completion=128)
    # (50,000 waiting prompt tokens + 100 x 128 to generate + 64 x 64 still running) / 1000 tok/s
    assert d.projected_wait_s == pytest.approx((50_000 + 12_800 + 64 * 64) / 1000)
    assert not d.admitted and d.status == 429 and d.reason == "queue_wait"
    assert d.retry_after_s == pytest.approx(d.projected_wait_s - 10.0)


def test_unsaturated_admits_with_tier_priority(controller):
    for tier, priority in [("premium", 0), ("standard", 1), ("batch", 2), ("unknown-tier", 1)]:
        d = controller.decide(IDLE, tier, drain_rate=1000.0, mean_completion=128)
        assert d.admitted and d.priority == priority and d.projected_wait_s == 0.0


def test_budgets_shed_lower_tiers_first(controller):
    load = report(num_waiting=10, num_running=8, num_waiting_prompt_tokens=3720, kv=0.5)
    decisions = {t: controller.decide(load, t, 1000.0, 128) for t in ("premium", "standard", "batch")}
    assert decisions["premium"].admitted and decisions["standard"].admitted  # 5 s < 30 s, 10 s
    assert not decisions["batch"].admitted and decisions["batch"].retry_after_s == pytest.approx(3.0)


def test_unhealthy_engine_is_503(controller):
    d = controller.decide(dataclasses.replace(IDLE, healthy=False), "premium", 1000.0, 128)
    assert (d.admitted, d.status, d.retry_after_s) == (False, 503, 5.0)


def test_unknown_drain_rate_admits(controller):
    assert controller.decide(SATURATED, "batch", drain_rate=None, mean_completion=128).admitted
    assert controller.decide(None, "batch", drain_rate=None, mean_completion=128).admitted  # no snapshot


def test_queue_length_cap_and_custom_tiers():
    config = AdmissionConfig(tier_priorities={"gold": 0, "free": 5}, tier_wait_budgets_s={"gold": 60, "free": 1},
                             default_tier="free", max_num_waiting=50)
    c = AdmissionController(config)
    load = report(num_waiting=50, num_running=1, num_waiting_prompt_tokens=10, kv=0.1)
    d = c.decide(load, "gold", 1000.0, 10)
    assert not d.admitted and d.reason == "queue_full" and d.retry_after_s >= 1
    assert c.decide(dataclasses.replace(load, num_waiting=1), "gold", 1000.0, 10).priority == 0
    with pytest.raises(ConfigError):
        AdmissionConfig(tier_priorities={"gold": 0}, tier_wait_budgets_s={"gold": 1}, default_tier="free")


def test_drain_rate_from_snapshot_counters():
    tracker = DrainRateTracker(half_life_s=5.0)
    t, total = 0.0, 0
    for _ in range(40):  # busy at 500 tokens/s
        busy = report(0.5, num_waiting=5, num_running=8, num_waiting_prompt_tokens=100, prompt_tokens_total=total)
        tracker.observe_snapshot(busy, t)
        t, total = t + 1.0, total + 500
    assert tracker.rate == pytest.approx(500.0)
    for _ in range(10):  # idle: no tokens, but idle time must not read as a slow engine
        tracker.observe_snapshot(report(prompt_tokens_total=total), t)
        t += 1.0
    assert tracker.rate == pytest.approx(500.0)
    tracker.observe_completion(100, 50, True, t)  # ignored for the rate: counters are the source
    assert tracker.rate == pytest.approx(500.0)
    tracker.check_invariants()


def test_drain_rate_from_completions():
    tracker = DrainRateTracker(half_life_s=5.0, default_completion_tokens=100)
    assert tracker.rate is None
    for i in range(30):
        tracker.observe_completion(200, 150, True, float(i) * 0.5)  # 400 tokens/s
    assert tracker.rate == pytest.approx(400.0)
    assert 135 < tracker.mean_completion_tokens < 150  # EWMA moving from the prior toward 150


def test_gateway_sheds_before_any_engine_work(make_gateway, store, clock):
    store.create_tenant("acme", tier="standard")
    key = store.create_key("acme")[1]
    gw = make_gateway()
    # Teach the gateway the engine drains 1000 tokens/s, from two busy snapshots 1 s apart.
    admit(gw, key, stats=stats(waiting=1, running=4, waiting_tokens=10, prompt_total=0))
    clock.advance(1.0)
    admit(gw, key, stats=stats(waiting=1, running=4, waiting_tokens=10, prompt_total=1000))
    assert gw.drain.rate == pytest.approx(1000.0)
    engine_calls = []  # a real server would call the engine only after admit returns
    with pytest.raises(APIError) as info:
        admit(gw, key, stats=stats(waiting=200, running=64, waiting_tokens=80_000, kv=0.99, prompt_total=1000))
        engine_calls.append("add_request")
    err = info.value
    assert err.status == 429 and err.code == "server_overloaded" and int(err.headers["Retry-After"]) >= 1
    assert engine_calls == []
    rejected = gw.audit.recent(1)[0]
    assert (rejected.status, rejected.error_code, rejected.tenant) == (429, "server_overloaded", "acme")
    with pytest.raises(APIError) as info:
        gw.admit_sync({"Authorization": f"Bearer {key}"}, None, "m", 1, 1, stats(), engine_healthy=False)
    assert info.value.status == 503 and info.value.headers["Retry-After"] == "5"


def test_output_budgets_follow_the_max_tokens_of_the_queue(controller):
    """With the engine's output budgets the projection does not depend on what earlier requests
    looked like: after a run of 1-token requests (mean completion 1), eight queued 48-token
    requests in a full batch still count as 8 x 48 x the used fraction (and the 2 running ones' 30
    each, whose slots the queue needs)."""
    load = report(num_waiting=8, num_running=2, num_waiting_prompt_tokens=800, kv=0.1,
                  num_waiting_output_tokens=8 * 48, num_running_output_tokens=2 * 30, max_num_seqs=10)
    d = controller.decide(load, "standard", drain_rate=100.0, mean_completion=1.0, output_fraction=1.0)
    assert d.projected_wait_s == pytest.approx((800 + 384 + 60) / 100)
    half = controller.decide(load, "standard", drain_rate=100.0, mean_completion=1.0, output_fraction=0.5)
    assert half.projected_wait_s == pytest.approx((800 + 192 + 30) / 100)


def test_a_full_batch_adds_the_running_work_that_frees_the_needed_slots(controller):
    """8 of 8 slots busy, 2 queued: the new request needs 3 slots to free, so 3/8 of the running
    requests' remaining output is ahead of it too."""
    load = report(num_waiting=2, num_running=8, num_waiting_prompt_tokens=100, kv=0.3,
                  num_waiting_output_tokens=2 * 48, num_running_output_tokens=8 * 40, max_num_seqs=8)
    d = controller.decide(load, "standard", drain_rate=100.0, mean_completion=128, output_fraction=1.0)
    assert d.projected_wait_s == pytest.approx((100 + 96 + 320 * 3 / 8) / 100)
    roomy = dataclasses.replace(load, max_num_seqs=64)  # slots for all: only the queue's prompts are ahead
    assert controller.decide(roomy, "standard", 100.0, 128, 1.0).projected_wait_s == pytest.approx(100 / 100)


def test_a_burst_the_batch_has_room_for_waits_for_its_prompts_only(controller):
    """32 requests arrive at once at a server with 64 slots (bench/online.py's concurrency 32): the
    new one starts once the 32 prompts ahead of it are prefilled; their 32 x 32 output tokens are
    generated beside its own. Counting that output at a decode rate learned from one stream had
    projected 12 s and shed requests that finished in ~2.5 s."""
    load = report(num_waiting=32, num_running=0, num_waiting_prompt_tokens=32 * 128, kv=0.1,
                  num_waiting_output_tokens=32 * 32, num_waiting_certain_output_tokens=32 * 32, max_num_seqs=64)
    d = controller.decide(load, "standard", drain_rate=2000.0, mean_completion=128, output_fraction=1.0,
                          decode_rate=100.0)
    assert d.admitted and d.projected_wait_s == pytest.approx(4096 / 2000)
    full = dataclasses.replace(load, max_num_seqs=32)  # no slot left: the queue's output is ahead too
    assert controller.decide(full, "standard", 2000.0, 128, 1.0, 100.0).projected_wait_s == \
        pytest.approx(4096 / 2000 + 1024 / 100)


def test_tracker_learns_the_used_fraction_of_max_tokens():
    tracker = DrainRateTracker()
    assert tracker.output_fraction == 1.0
    for _ in range(60):
        tracker.observe_completion(100, 25, False, 0.0, max_tokens=100)
    assert tracker.output_fraction == pytest.approx(0.25, abs=0.01)
    tracker.observe_completion(100, 500, False, 0.0, max_tokens=100)  # never above 1
    tracker.check_invariants()


def test_ignore_eos_and_min_tokens_output_is_counted_in_full(controller):
    """A learned fraction of 5% (earlier requests stopped early) must not shrink output that is
    sure to be generated: ignore_eos requests produce all of max_tokens."""
    load = report(num_waiting=70, num_running=8, num_waiting_prompt_tokens=2100, kv=0.2,
                  num_waiting_output_tokens=70 * 48, num_running_output_tokens=8 * 20, max_num_seqs=8,
                  num_waiting_certain_output_tokens=70 * 48, num_running_certain_output_tokens=8 * 20)
    d = controller.decide(load, "batch", drain_rate=1000.0, mean_completion=128, output_fraction=0.05)
    assert d.projected_wait_s == pytest.approx((2100 + 3360 + 160) / 1000)
    assert not d.admitted
    unsure = dataclasses.replace(load, num_waiting_certain_output_tokens=0, num_running_certain_output_tokens=0)
    assert controller.decide(unsure, "batch", 1000.0, 128, 0.05).projected_wait_s == \
        pytest.approx((2100 + 0.05 * 3360 + 0.05 * 160) / 1000)


def test_output_drains_at_the_decode_rate(controller):
    """Prompt tokens prefill ~10x faster than output decodes: in a full batch, a queue of 48-token
    answers is projected at the decode pace, not at the mixed rate a prefill-heavy past would suggest."""
    load = report(num_waiting=20, num_running=8, num_waiting_prompt_tokens=600, kv=0.2,
                  num_waiting_output_tokens=20 * 48, num_running_output_tokens=0, max_num_seqs=28,
                  num_waiting_certain_output_tokens=20 * 48)
    d = controller.decide(load, "batch", drain_rate=2000.0, mean_completion=128, output_fraction=1.0,
                          decode_rate=100.0)
    assert d.projected_wait_s == pytest.approx(600 / 2000 + 960 / 100) and not d.admitted
    mixed = controller.decide(load, "batch", drain_rate=2000.0, mean_completion=128, output_fraction=1.0)
    assert mixed.projected_wait_s == pytest.approx(1560 / 2000) and mixed.admitted


def test_tracker_measures_the_decode_rate_from_counters():
    tracker = DrainRateTracker(half_life_s=1e-9)  # follow the last interval exactly
    busy = report(0.2, num_waiting=1, num_running=8, num_waiting_prompt_tokens=10)
    tracker.observe_snapshot(busy, 0.0)
    tracker.observe_snapshot(dataclasses.replace(busy, prompt_tokens_total=1000, generation_tokens_total=100), 1.0)
    assert tracker.rate == pytest.approx(1100.0) and tracker.decode_rate == pytest.approx(100.0)
    # prefill only
    tracker.observe_snapshot(dataclasses.replace(busy, prompt_tokens_total=2000, generation_tokens_total=100), 2.0)
    assert tracker.decode_rate == pytest.approx(100.0)
    tracker.check_invariants()
