"""The router's Prometheus metrics: routing decisions, retries, ejections, fallbacks and, read
from the registry at scrape time, each upstream's health and load."""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ferrylm.observability.buckets import TTFT_BUCKETS
from ferrylm.observability.tenant_metrics import TenantLatency, TenantMetricsConfig

PREFIX = "ferrylm:router_"


class ReplicaCollector(Collector):
    """Per-replica gauges from the live registry, so they can never drift from the router's state."""

    def __init__(self, registry):
        self._registry = registry

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        labels = ["model_group", "replica"]
        fams = {name: GaugeMetricFamily(PREFIX + name, doc, labels=labels) for name, doc in [
            ("upstream_up", "1 if the replica's /ready answered 200 at the last poll."),
            ("upstream_healthy", "1 if the replica is ready and not ejected by its circuit breaker."),
            ("upstream_breaker_state", "Circuit breaker: 0 closed, 1 half-open, 2 open (ejected)."),
            ("upstream_outstanding_tokens", "Prompt tokens to prefill plus expected tokens to decode in flight."),
            ("upstream_in_flight_requests", "Requests the router has in flight on the replica."),
            ("upstream_ttft_ewma_seconds", "EWMA of the time to first token the router observed."),
            ("upstream_num_requests_waiting", "The replica's queue depth at the last poll."),
            ("upstream_kv_cache_usage_perc", "The replica's KV cache usage at the last poll."),
            ("upstream_ejections", "Times the circuit breaker ejected the replica.")]}
        now = time.monotonic()
        for r in self._registry.replicas():
            key = [r.group, r.url]
            fams["upstream_up"].add_metric(key, float(r.ready))
            fams["upstream_healthy"].add_metric(key, float(r.available(now)))
            fams["upstream_breaker_state"].add_metric(key, float(r.breaker.state))
            fams["upstream_outstanding_tokens"].add_metric(key, float(r.outstanding_tokens))
            fams["upstream_in_flight_requests"].add_metric(key, float(r.in_flight))
            fams["upstream_ttft_ewma_seconds"].add_metric(key, r.ttft_ewma_s or 0.0)
            fams["upstream_ejections"].add_metric(key, float(r.breaker.ejections))
            if r.load is not None:
                fams["upstream_num_requests_waiting"].add_metric(key, float(r.load.num_waiting))
                fams["upstream_kv_cache_usage_perc"].add_metric(key, r.load.kv_cache_usage)
        return list(fams.values())


class RouterMetrics:
    def __init__(self, registry, tenants: TenantMetricsConfig | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # ferrylm:tenant_*{model_name=<group>, tenant}: the same names `ferrylm serve` uses
        self.tenants = TenantLatency(r, tenants or TenantMetricsConfig())
        self.requests = Counter(PREFIX + "requests", "Requests answered, by model group and status.",
                                ["model_group", "status"], registry=r)
        self.decisions = Counter(PREFIX + "routing_decisions", "Replica choices, by policy and reason "
                                 "(prefix_match, prefix_hash, spill, least_outstanding, round_robin, latency).",
                                 ["model_group", "policy", "reason"], registry=r)
        self.retries = Counter(PREFIX + "retries", "Tries repeated on another replica before the first token.",
                               ["model_group", "reason"], registry=r)
        self.retries_denied = Counter(PREFIX + "retries_denied", "Retries refused by the fleet retry budget.",
                                      ["model_group"], registry=r)
        self.ejections = Counter(PREFIX + "ejections", "Circuit-breaker ejections.", ["model_group", "replica"],
                                 registry=r)
        self.fallbacks = Counter(PREFIX + "fallbacks", "Requests sent to a fallback model group.",
                                 ["model_group", "fallback_group"], registry=r)
        self.stream_errors = Counter(PREFIX + "stream_errors", "Streams ended by an error event after tokens "
                                     "had been sent (a replica failed mid-stream).", ["model_group"], registry=r)
        self.kv_transfers = Counter(PREFIX + "kv_transfers", "Disaggregated prefills: the prompt run on a "
                                    "prefill replica and its KV blocks moved to the decode replica (outcome ok), or "
                                    "not (failed: the decode replica recomputes the prompt).",
                                    ["model_group", "outcome"], registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token through the router.",
                              ["model_group"], buckets=TTFT_BUCKETS, registry=r)
        r.register(ReplicaCollector(registry))

    def render(self) -> bytes:
        return generate_latest(self.registry)
