"""The dashboard's numbers on their own: percentiles from histogram bucket deltas (checked against
exact percentiles of the observations, within a bucket), rates and per-step averages from counter
deltas, the trailing window, resets, and the ring buffer's bound; the KV cache tiers panel (occupancy,
hit tokens and blocks moved with their rates, the disk's load-back latency, "off" for a tier that is off)."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest
from prometheus_client import CollectorRegistry, Histogram

from ferrylm.load_report import LoadReport
from ferrylm.observability.dashboard.quantiles import Buckets, histogram_quantile
from ferrylm.observability.dashboard.readings import counters_of, gauges_of, read_buckets, server_reader
from ferrylm.observability.dashboard.sampler import (
    Counters,
    DashboardConfig,
    DashboardSampler,
    Gauges,
    Health,
    Reading,
)
from ferrylm.observability.dashboard.tiers import TierCounters, tier_counters
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


# -- the KV cache tiers panel --------------------------------------------------------------------

BLOCK_BYTES = 65536


def tier_load(**fields) -> LoadReport:
    """A LoadReport with only the tier figures given (the rest as an idle engine's)."""
    return dataclasses.replace(LoadReport.empty(), **fields)


BEFORE = tier_load(kv_blocks_used=100, kv_blocks_total=400, prefix_cache_queries=1000, prefix_cache_hits=600,
                   kv_offload_hit_tokens=200, kv_offload_blocks_out=50, kv_offload_blocks_in=10,
                   kv_offload_blocks_used=30, kv_offload_blocks_total=120,
                   kv_offload_disk_hit_tokens=64, kv_offload_disk_blocks_written=40, kv_offload_disk_blocks_read=4,
                   kv_offload_disk_blocks_lost=1, kv_offload_disk_bytes_written=40 * BLOCK_BYTES,
                   kv_offload_disk_bytes_read=4 * BLOCK_BYTES, kv_offload_disk_read_seconds=0.02,
                   kv_offload_disk_blocks_used=40, kv_offload_disk_blocks_total=1000)
# four seconds later: +800 hits of which +320 from the host tier, +128 read up from disk, 8 files
# read in 0.08 s, one more lost
AFTER = tier_load(kv_blocks_used=300, kv_blocks_total=400, prefix_cache_queries=2000, prefix_cache_hits=1400,
                  kv_offload_hit_tokens=520, kv_offload_blocks_out=90, kv_offload_blocks_in=30,
                  kv_offload_blocks_used=60, kv_offload_blocks_total=120,
                  kv_offload_disk_hit_tokens=192, kv_offload_disk_blocks_written=60, kv_offload_disk_blocks_read=12,
                  kv_offload_disk_blocks_lost=2, kv_offload_disk_bytes_written=60 * BLOCK_BYTES,
                  kv_offload_disk_bytes_read=12 * BLOCK_BYTES, kv_offload_disk_read_seconds=0.1,
                  kv_offload_disk_blocks_used=60, kv_offload_disk_blocks_total=1000)


def load_reading(t: float, load: LoadReport) -> Reading:
    return Reading(wall=1000.0 + t, mono=t, counters=counters_of(load), gauges=gauges_of(load), ttft=None, itl=None,
                   tiers=tier_counters([load], [load]))


def tiers_panel(*readings: Reading, config: DashboardConfig | None = None) -> dict:
    sampler = DashboardSampler(lambda: readings[0], "serve", config or DashboardConfig())
    for r in readings:
        sampler.add(r)
    panel = sampler.to_json()["kv_tiers"]
    json.dumps(panel, allow_nan=False)  # what /dashboard/data sends: no NaN, no infinity
    return panel


def moves(row: dict) -> tuple:
    """Blocks out and in: totals and rates."""
    return row["blocks_out"], row["blocks_out_per_s"], row["blocks_in"], row["blocks_in_per_s"]


def test_tier_panel_occupancy_hits_moves_rates_and_disk_latency():
    panel = tiers_panel(load_reading(0, BEFORE), load_reading(4, AFTER))
    assert panel["seconds"] == 4.0
    device, host, disk = panel["tiers"]
    assert [device["tier"], host["tier"], disk["tier"]] == ["device", "host", "disk"]
    assert device["on"] and host["on"] and disk["on"]
    # the device pool: prefix_cache_hits less the host tier's share (1400 - 520), rate (800 - 320) / 4 s
    assert (device["blocks_used"], device["blocks_total"], device["occupancy"]) == (300, 400, 0.75)
    assert device["hit_tokens"] == 880 and device["hit_tokens_per_s"] == 120.0
    assert device["blocks_out"] is None and device["load_latency_s"] is None, "moves are the lower tiers'"
    assert (host["occupancy"], host["hit_tokens"], host["hit_tokens_per_s"]) == (0.5, 520, 80.0)
    assert moves(host) == (90, 10.0, 30, 5.0)
    assert host["bytes_out"] is None and host["blocks_lost"] is None
    assert (disk["blocks_used"], disk["blocks_total"], disk["occupancy"]) == (60, 1000, 0.06)
    assert (disk["hit_tokens"], disk["hit_tokens_per_s"]) == (192, 32.0)
    assert moves(disk) == (60, 5.0, 12, 2.0)
    assert (disk["bytes_out"], disk["bytes_out_per_s"]) == (60 * BLOCK_BYTES, 5.0 * BLOCK_BYTES)
    assert (disk["bytes_in"], disk["bytes_in_per_s"]) == (12 * BLOCK_BYTES, 2.0 * BLOCK_BYTES)
    assert disk["load_latency_s"] == pytest.approx(0.01)  # 0.08 s over the window's 8 reads
    assert disk["load_latency_total_s"] == pytest.approx(0.1 / 12, abs=1e-6)  # since start (to the µs)
    assert disk["blocks_lost"] == 2


def test_a_tier_that_is_off_is_off_not_zeros():
    no_tiers = tier_load(kv_blocks_used=5, kv_blocks_total=10, prefix_cache_queries=100, prefix_cache_hits=40)
    panel = tiers_panel(load_reading(0, no_tiers), load_reading(1, no_tiers))
    device, host, disk = panel["tiers"]
    assert device["on"] and device["occupancy"] == 0.5 and device["hit_tokens"] == 40
    assert device["hit_tokens_per_s"] == 0.0, "on and idle: a rate of zero"
    for row in (host, disk):
        assert row["on"] is False
        assert all(v is None for k, v in row.items() if k not in ("tier", "on")), row
    host_only = dataclasses.replace(no_tiers, kv_offload_blocks_total=8)
    _, host, disk = tiers_panel(load_reading(0, host_only))["tiers"]
    assert host["on"] and host["occupancy"] == 0.0 and host["hit_tokens_per_s"] is None, "one reading: no rate"
    assert disk["on"] is False
    [device, *_] = tiers_panel(load_reading(0, LoadReport.empty()))["tiers"]
    assert device == {**dict.fromkeys(device, None), "tier": "device", "on": False}


def test_tier_rates_cover_the_trailing_window_and_a_reset_reads_as_zero():
    config = DashboardConfig(interval_s=1.0, window_s=60.0, percentile_window_s=2.0)
    steady = [load_reading(t, dataclasses.replace(BEFORE, kv_offload_hit_tokens=200 + 16 * t)) for t in range(3)]
    burst = load_reading(3, dataclasses.replace(BEFORE, kv_offload_hit_tokens=200 + 32 + 96))
    _, host, _ = tiers_panel(*steady, burst, config=config)["tiers"]
    assert host["hit_tokens_per_s"] == 56.0, "(328 - 216) over the 2 s since the reading one window back"
    restarted = load_reading(4, tier_load(kv_blocks_total=400, kv_offload_blocks_total=120, kv_offload_hit_tokens=16,
                                          kv_offload_disk_blocks_total=1000, kv_offload_disk_read_seconds=0.001,
                                          kv_offload_disk_blocks_read=1))
    device, host, disk = tiers_panel(*steady, burst, restarted, config=config)["tiers"]
    assert device["hit_tokens_per_s"] == 0.0 and host["hit_tokens_per_s"] == 0.0 and host["hit_tokens"] == 16
    assert disk["load_latency_s"] is None, "no read counted in the window (a reset): no latency"
    assert disk["load_latency_total_s"] == 0.001


def test_nothing_reporting_has_no_tier_panel():
    sampler = DashboardSampler(lambda: Reading(wall=1.0, mono=1.0, counters=None, gauges=None, ttft=None, itl=None),
                               "serve")
    sampler.sample()
    assert sampler.to_json()["kv_tiers"] is None


def test_server_reader_takes_the_tiers_from_the_engine_report():
    read = server_reader(lambda: AFTER, CollectorRegistry(), lambda: Health("this server", "ok", True, {}))
    assert read().tiers == TierCounters(**{name: getattr(AFTER, name) for name in TierCounters._fields})
    assert server_reader(lambda: None, CollectorRegistry(), lambda: Health("x", "loading", False, {}))().tiers is None


def test_gateway_tiers_sum_every_report_and_the_ready_ones_occupancy():
    """Cumulative figures over every replica that reported, occupancy over the ready ones; the disk read
    seconds (a float) are summed too."""
    down = dataclasses.replace(BEFORE, kv_offload_disk_read_seconds=0.5)
    tiers = tier_counters([AFTER, down], [AFTER])
    assert tiers is not None
    assert tiers.prefix_cache_hits == 2000 and tiers.kv_offload_disk_blocks_read == 16
    assert tiers.kv_offload_disk_read_seconds == pytest.approx(0.6)
    assert (tiers.kv_blocks_used, tiers.kv_offload_blocks_used, tiers.kv_offload_disk_blocks_total) == (300, 60, 1000)
    assert tier_counters([AFTER], []) is None, "no replica ready: no panel"
