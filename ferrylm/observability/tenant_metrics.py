"""Per-tenant latency histograms (TTFT, inter-token latency, e2e) with a bounded `tenant` label.

A label per tenant would let an unbounded tenant table blow up the scrape, so the label values
are bounded: the tenants named in the config (`--metrics-tenants`) get their own series, or,
without such a list, the first `max_tenants` tenants seen (`--max-metrics-tenants`, by arrival
order) do; every other tenant is counted under `other`. Both front doors use this class
(`ferrylm serve` with its own gateway policy, `ferrylm gateway` in front of replicas)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram

from ferrylm.config import ConfigError
from ferrylm.observability.buckets import ITL_BUCKETS, REQUEST_BUCKETS, TTFT_BUCKETS

OTHER = "other"


@dataclass(frozen=True)
class TenantMetricsConfig:
    """Which tenants get a series of their own (`names`, or the first `max_tenants` seen)."""

    names: tuple[str, ...] = ()
    max_tenants: int = 20

    def __post_init__(self) -> None:
        if self.max_tenants < 0:
            raise ConfigError("--max-metrics-tenants must be 0 or more")
        if OTHER in self.names:
            raise ConfigError(f"--metrics-tenants cannot name {OTHER!r}: it is the label of every other tenant")


class TenantLabels:
    """Maps a tenant to its label value: itself while the budget lasts, else `other`."""

    def __init__(self, config: TenantMetricsConfig):
        self._config = config
        self._seen: set[str] = set(config.names)

    def __call__(self, tenant: str) -> str:
        if tenant in self._seen:
            return tenant
        if self._config.names or len(self._seen) >= self._config.max_tenants or tenant == OTHER:
            return OTHER
        self._seen.add(tenant)
        return tenant


class TenantLatency:
    """`ferrylm:tenant_time_to_first_token_seconds`, `..._inter_token_latency_seconds` and
    `..._e2e_request_latency_seconds`, labelled {model_name, tenant}, vLLM's buckets."""

    def __init__(self, registry: CollectorRegistry, config: TenantMetricsConfig, prefix: str = "ferrylm:"):
        self.label = TenantLabels(config)
        labels = ["model_name", "tenant"]
        self._ttft = Histogram(prefix + "tenant_time_to_first_token_seconds", "Time to first token, per tenant.",
                               labels, buckets=TTFT_BUCKETS, registry=registry)
        self._itl = Histogram(prefix + "tenant_inter_token_latency_seconds", "Time between tokens, per tenant.",
                              labels, buckets=ITL_BUCKETS, registry=registry)
        self._e2e = Histogram(prefix + "tenant_e2e_request_latency_seconds", "Request latency, per tenant.",
                              labels, buckets=REQUEST_BUCKETS, registry=registry)

    def ttft(self, model: str, tenant: str, seconds: float) -> None:
        self._ttft.labels(model, self.label(tenant)).observe(seconds)

    def itl(self, model: str, tenant: str, seconds: float, count: int = 1) -> None:
        """`count` gaps of `seconds` each (several tokens arrived at once: the gap is shared)."""
        child = self._itl.labels(model, self.label(tenant))
        for _ in range(count):
            child.observe(seconds)

    def e2e(self, model: str, tenant: str, seconds: float) -> None:
        self._e2e.labels(model, self.label(tenant)).observe(seconds)
