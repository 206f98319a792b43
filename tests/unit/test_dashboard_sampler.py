"""The dashboard's numbers on their own: percentiles from histogram bucket deltas (checked against
exact percentiles of the observations, within a bucket), rates and per-step averages from counter
deltas, the trailing window, resets, and the ring buffer's bound."""

from __future__ import annotations

import math
import random

import pytest
from prometheus_client import CollectorRegistry, Histogram

from ferrylm.observability.dashboard.quantiles import Buckets, histogram_quantile
from ferrylm.observability.dashboard.readings import read_buckets
from ferrylm.observability.dashboard.sampler import (
    Counters,
    DashboardConfig,
    DashboardSampler,
    Gauges,
    Health,
    Reading,
)
from ferrylm.observability.metrics import TTFT_BUCKETS

INF = math.inf


def test_quantile_interpolates_inside_the_bucket_like_promql():
    b = Buckets((0.1, 0.2, 0.4, INF), (0.0, 10.0, 10.0, 10.0))  # 10 observations in (0.1, 0.2]
    assert histogram_quantile(0.5, b) == pytest.approx(0.15)
    assert histogram_quantile(0.99, b) == pytest.approx(0.199)
    assert histogram_quantile(0.5, Buckets((1.0, INF), (0.0, 4.0))) == 1.0  # +Inf bucket: largest finite bound
    assert histogram_quantile(0.5, Buckets((1.0, INF), (0.0, 0.0))) is None
    with pytest.raises(ValueError):
        histogram_quantile(1.5, b)


def test_quantile_of_real_prometheus_buckets_is_within_the_true_bucket():
    rng = random.Random(7)
    registry = CollectorRegistry()
    hist = Histogram("ferrylm:time_to_first_token_seconds", "t", ["model_name"], buckets=TTFT_BUCKETS,
                     registry=registry)
    before = read_buckets(registry, "ferrylm:time_to_first_token_seconds")
    assert before is None  # no label set observed yet
    hist.labels("a").observe(50.0)  # before the window: must not count
    start = read_buckets(registry, "ferrylm:time_to_first_token_seconds")
    values = [rng.lognormvariate(-2.5, 0.8) for _ in range(500)]
    for i, v in enumerate(values):
        hist.labels("ab"[i % 2]).observe(v)  # two label sets are summed
    window = read_buckets(registry, "ferrylm:time_to_first_token_seconds").minus(start)
    assert window.total == 500
    values.sort()
    bounds = (0.0, *TTFT_BUCKETS, INF)
    for q in (0.5, 0.99):
        exact = values[math.ceil(q * len(values)) - 1]
        lo = max(b for b in bounds if b < exact)
        hi = min(b for b in bounds if b >= exact)
        assert lo <= histogram_quantile(q, window) <= hi


def test_minus_treats_a_counter_reset_as_nothing_observed():
    old = Buckets((1.0, INF), (5.0, 9.0))
    assert Buckets((1.0, INF), (1.0, 2.0)).minus(old).total == 0
    with pytest.raises(ValueError):
        Buckets((2.0, INF), (5.0, 9.0)).minus(old)


def reading(t: float, gen: int = 0, prefill: int = 0, decode: int = 0, steps: int = 0, queries: int = 0,
            hits: int = 0, ttft: tuple[float, float] = (0.0, 0.0), health: tuple[Health, ...] = ()) -> Reading:
    return Reading(wall=1000.0 + t, mono=t,
                   counters=Counters(prompt_tokens=prefill, generation_tokens=gen, prefill_tokens=prefill,
                                     decode_tokens=decode, steps=steps, prefix_cache_queries=queries,
                                     prefix_cache_hits=hits),
                   gauges=Gauges(num_waiting=1, num_running=2, kv_cache_usage=0.25),
                   ttft=Buckets((0.1, INF), ttft), itl=None, health=health)


def test_points_rates_per_step_averages_and_trailing_window():
    config = DashboardConfig(interval_s=1.0, window_s=5.0, percentile_window_s=2.0)
    sampler = DashboardSampler(lambda: reading(0), "serve", config)
    up = Health("this server", "ok", True, {})
    sampler.add(reading(0, health=(up,)))
    sampler.add(reading(1, gen=40, prefill=300, decode=40, steps=4, queries=100, hits=25, ttft=(2.0, 2.0)))
    sampler.add(reading(2, gen=90, prefill=300, decode=90, steps=9, queries=100, hits=25, ttft=(2.0, 4.0)))
    sampler.add(reading(3, gen=90, prefill=300, decode=90, steps=9, queries=200, hits=125, ttft=(2.0, 4.0)))
    sampler.check_invariants()
    s = sampler.to_json()["series"]
    assert s["generation_tokens_per_s"] == [None, 40.0, 50.0, 0.0]  # the first point has no interval
    assert s["prefill_tokens_per_step"] == [None, 75.0, 0.0, None]  # no step in the last second: no average
    assert s["decode_tokens_per_step"] == [None, 10.0, 10.0, None]
    assert s["prefix_cache_hit_rate"] == [None, 0.25, 0.25, 1.0]  # the last point covers seconds 1..3 only
    assert s["ttft_p50"][1] == pytest.approx(0.05) and s["ttft_p50"][2] == pytest.approx(0.1)
    assert s["ttft_p99"][3] == pytest.approx(0.1)  # 2..4: only the two +Inf observations remain
    assert s["num_running"] == [2, 2, 2, 2] and s["kv_cache_usage"] == [0.25] * 4
    assert s["healthy"] == [1, 0, 0, 0] and s["t"] == [1000.0, 1001.0, 1002.0, 1003.0]
    summary = sampler.to_json()["summary"]
    assert summary["generation_tokens_per_s"] == 30.0 and summary["prefix_cache_hit_rate"] == 0.625


def test_ring_buffer_keeps_the_window_and_a_reset_reads_as_zero():
    config = DashboardConfig(interval_s=1.0, window_s=3.0, percentile_window_s=1.0)
    sampler = DashboardSampler(lambda: reading(0), "gateway", config)
    for t in range(10):
        sampler.add(reading(t, gen=100 * t))
        sampler.check_invariants()
    sampler.add(reading(10, gen=5))  # a replica restarted: its counters went back
    data = sampler.to_json()
    assert data["num_points"] == config.capacity == 4
    assert data["series"]["generation_tokens_per_s"] == [100.0, 100.0, 100.0, 0.0]


def test_nothing_reporting_yet_is_none_not_zero():
    empty = Reading(wall=1.0, mono=1.0, counters=None, gauges=None, ttft=None, itl=None)
    sampler = DashboardSampler(lambda: empty, "serve")
    point = sampler.sample()
    assert point.num_waiting is None and point.ttft_p50 is None and point.generation_tokens_per_s is None


def test_config_is_checked():
    with pytest.raises(ValueError):
        DashboardConfig(interval_s=2.0, percentile_window_s=1.0)


def test_windows_start_at_the_first_reading_that_reported():
    """Readings before the engine loaded have no counters: the hit rate and the summary cover what came after."""
    config = DashboardConfig(interval_s=1.0, window_s=60.0, percentile_window_s=10.0)
    sampler = DashboardSampler(lambda: reading(0), "serve", config)
    for t in range(5):
        sampler.add(Reading(wall=t, mono=t, counters=None, gauges=None, ttft=None, itl=None))
    sampler.add(reading(5, gen=0, queries=0))
    sampler.add(reading(6, gen=20, queries=100, hits=40))
    assert sampler.to_json()["series"]["prefix_cache_hit_rate"][-1] == 0.4
    summary = sampler.to_json()["summary"]
    assert summary["prefix_cache_hit_rate"] == 0.4 and summary["generation_tokens_per_s"] == 20.0
