"""Readings for the dashboard sampler, taken from what each app already keeps: `ferrylm serve`'s
engine LoadReport and Prometheus histograms; `ferrylm gateway`'s replicas as the router sees
them (poller readiness, circuit breaker, last /load) and its own TTFT histogram; on both, the
prefix cache's tiers from the LoadReport (tiers.py). Read-only."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry

from ferrylm.load_report import LoadReport
from ferrylm.observability.dashboard.quantiles import Buckets
from ferrylm.observability.dashboard.sampler import Counters, Gauges, Health, Reading
from ferrylm.observability.dashboard.tiers import tier_counters
from ferrylm.observability.metrics import PREFIX

SERVER_TTFT = PREFIX + "time_to_first_token_seconds"
SERVER_ITL = PREFIX + "inter_token_latency_seconds"


def read_buckets(registry: CollectorRegistry, name: str) -> Buckets | None:
    """Histogram `name`'s cumulative bucket counts, summed over its label sets (None: no such metric)."""
    for family in registry.collect():
        if family.name != name or family.type != "histogram":
            continue
        counts: dict[float, float] = {}
        for sample in family.samples:
            if sample.name == name + "_bucket":
                le = float(sample.labels["le"])
                counts[le] = counts.get(le, 0.0) + sample.value
        if not counts:
            return None
        bounds = tuple(sorted(counts))
        return Buckets(bounds, tuple(counts[b] for b in bounds))
    return None


def counters_of(load: LoadReport) -> Counters:
    return Counters(prompt_tokens=load.prompt_tokens_total, generation_tokens=load.generation_tokens_total,
                    prefill_tokens=load.prefill_tokens_total, decode_tokens=load.decode_tokens_total,
                    steps=load.num_steps_total, prefix_cache_queries=load.prefix_cache_queries,
                    prefix_cache_hits=load.prefix_cache_hits)


def gauges_of(load: LoadReport) -> Gauges:
    return Gauges(num_waiting=load.num_waiting, num_running=load.num_running, kv_cache_usage=load.kv_cache_usage)


def server_reader(stats: Callable[[], LoadReport | None], registry: CollectorRegistry,
                  health: Callable[[], Health]) -> Callable[[], Reading]:
    """`ferrylm serve`: the engine's snapshot, the latency histograms it serves on /metrics, itself."""

    def read() -> Reading:
        load = stats()
        return Reading(wall=time.time(), mono=time.monotonic(),
                       counters=counters_of(load) if load is not None else None,
                       gauges=gauges_of(load) if load is not None else None,
                       ttft=read_buckets(registry, SERVER_TTFT), itl=read_buckets(registry, SERVER_ITL),
                       health=(health(),), tiers=tier_counters([load], [load]) if load is not None else None)

    return read


def replica_health(replica: Any, now: float) -> Health:
    """One replica as the router sees it (duck-typed router.replica.Replica: this package sits below router/)."""
    breaker = replica.breaker.state.name.lower().replace("_", "-")
    if not replica.ready:
        state = "not ready" if replica.ever_ready else "never ready"
    elif not replica.breaker.available(now):
        state = "ejected"
    elif breaker != "closed":
        state = breaker
    else:
        state = "ok"
    load = replica.load
    ttft = replica.ttft_ewma_s
    detail = {"group": replica.group, "ready": replica.ready, "breaker": breaker,
              "poll_failures": replica.poll_failures, "in_flight": replica.in_flight,
              "outstanding_tokens": replica.outstanding_tokens,
              "ttft_ewma_s": round(ttft, 6) if ttft is not None and math.isfinite(ttft) else None,
              "num_waiting": load.num_waiting if load else None, "num_running": load.num_running if load else None,
              "kv_cache_usage": round(load.kv_cache_usage, 6) if load else None}
    return Health(name=replica.url, state=state, ok=replica.available(now), detail=detail)


def gateway_reader(replicas: Callable[[], Iterable[Any]], registry: CollectorRegistry,
                   ttft_name: str) -> Callable[[], Reading]:
    """`ferrylm gateway`: the fleet's counters summed over every replica that has reported (so they
    stay monotonic when one goes down), gauges over the ready ones, the router's own TTFT; the tiers'
    figures split the same way (tiers.tier_counters)."""

    def read() -> Reading:
        now = time.monotonic()
        all_replicas = list(replicas())
        loads = [r.load for r in all_replicas if r.load is not None]
        ready = [r.load for r in all_replicas if r.load is not None and r.ready]
        return Reading(wall=time.time(), mono=now,
                       counters=counters_of(LoadReport.combine(loads)) if loads else None,
                       gauges=gauges_of(LoadReport.combine(ready)) if ready else None,
                       ttft=read_buckets(registry, ttft_name), itl=None,
                       health=tuple(replica_health(r, now) for r in all_replicas),
                       tiers=tier_counters(loads, ready))

    return read
