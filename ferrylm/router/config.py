"""RouterConfig: which upstream replicas serve which model names, how a replica is picked, and
how failures are handled. Built from a YAML file, from `--upstream` flags, or both."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ferrylm.config import ConfigError
from ferrylm.gateway.config import GatewayConfig
from ferrylm.gateway.ops_auth import check_credential_sources
from ferrylm.http.config import ConnectionLimits
from ferrylm.observability.tenant_metrics import TenantMetricsConfig
from ferrylm.observability.tracing import TracingConfig

POLICIES = ("round-robin", "least-outstanding-tokens", "prefix-affinity", "latency", "disaggregated")


@dataclass(frozen=True)
class GroupConfig:
    """One model group: clients ask for `name` (or an alias); any of `upstreams` can serve it."""

    name: str
    upstreams: tuple[str, ...]
    policy: str = "least-outstanding-tokens"
    aliases: tuple[str, ...] = ()
    fallback: str | None = None  # another group to use when every replica of this one is down
    tokenizer: str | None = None  # model source for token counts and prefix hashes (default: `name`)
    # disaggregated: replicas started with --kv-role prefill; each request's prompt is prefilled on one
    # and its KV blocks moved to the chosen `upstreams` replica (--kv-role decode) before it is sent there
    prefill_upstreams: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "upstreams", tuple(u.rstrip("/") for u in self.upstreams))
        object.__setattr__(self, "prefill_upstreams", tuple(u.rstrip("/") for u in self.prefill_upstreams))
        if (self.policy == "disaggregated") != bool(self.prefill_upstreams):
            raise ConfigError(f"model group {self.name!r}: the disaggregated policy and prefill upstreams "
                              "(--prefill-upstream) go together")
        object.__setattr__(self, "aliases", tuple(self.aliases))
        if not self.upstreams:
            raise ConfigError(f"model group {self.name!r} has no upstreams")
        if self.policy not in POLICIES:
            raise ConfigError(f"model group {self.name!r}: unknown policy {self.policy!r} "
                              f"(one of {', '.join(POLICIES)})")
        for url in self.upstreams + self.prefill_upstreams:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"upstream {url!r} must be an http:// or https:// URL")


@dataclass(frozen=True)
class RouterConfig:
    """The fleet and the failure-handling knobs (defaults follow Envoy-style practice)."""

    groups: tuple[GroupConfig, ...]
    poll_interval_s: float = 1.0  # active readiness polling of every upstream's /ready and /load
    poll_timeout_s: float = 6.0  # /ready runs a real token (the replica's own probe waits up to 5 s)
    poll_failures: int = 3  # slow or failed probes in a row before a replica leaves rotation
    breaker_failures: int = 3  # consecutive failures that eject a replica
    breaker_open_s: float = 5.0  # ejected this long, then one half-open probe decides
    max_attempts: int = 3  # tries per request across replicas, before the first byte only
    retry_backoff_s: float = 0.05  # doubled per retry
    retry_budget_ratio: float = 0.2  # retries may add at most this fraction of requests ...
    retry_budget_min: float = 3.0  # ... plus this many (so a quiet fleet can still retry)
    connect_timeout_s: float = 2.0
    first_byte_timeout_s: float = 300.0  # a replica that accepted but never answers
    affinity_credit: float = 1.0  # prefix affinity: a cached prompt token offsets this many outstanding ones
    affinity_map_size: int = 100_000  # block hashes remembered for prefix affinity
    default_max_tokens: int = 256  # no max_tokens and no replica has reported max_model_len yet
    upstream_api_key: str | None = None  # sent to the replicas as a Bearer token
    kv_transfer_key: str | None = None  # disaggregated: the replicas' --kv-transfer-key (KV routes take only it)
    expose_upstream: bool = False  # name the answering replica in an X-FerryLM-Upstream header

    def __post_init__(self) -> None:
        if not self.groups:
            raise ConfigError("the router needs at least one model group (--upstream or --router-config)")
        names: set[str] = set()
        for group in self.groups:
            for name in (group.name, *group.aliases):
                if name in names:
                    raise ConfigError(f"model name {name!r} is used twice")
                names.add(name)
        for group in self.groups:
            if group.fallback is not None and group.fallback not in {g.name for g in self.groups}:
                raise ConfigError(f"model group {group.name!r}: fallback {group.fallback!r} is not a group")
        if any(g.prefill_upstreams for g in self.groups) and not self.kv_transfer_key:
            raise ConfigError("the disaggregated policy needs --kv-transfer-key (env FERRYLM_KV_TRANSFER_KEY): "
                              "the replicas' KV routes take only that replica-to-replica secret")
        if min(self.max_attempts, self.breaker_failures, self.poll_failures) < 1:
            raise ConfigError("max_attempts, breaker_failures and poll_failures must be at least 1")
        if min(self.poll_interval_s, self.poll_timeout_s, self.breaker_open_s, self.connect_timeout_s) <= 0:
            raise ConfigError("router intervals and timeouts must be positive")

    def group(self, name: str) -> GroupConfig:
        return next(g for g in self.groups if g.name == name)


def _by_model(flags: list[str], default_model: str) -> dict[str, list[str]]:
    by_model: dict[str, list[str]] = {}
    for flag in flags:
        model, sep, url = flag.partition("=") if "=" in flag.split("://", 1)[0] else ("", "", flag)
        by_model.setdefault(model if sep else default_model, []).append(url)
    return by_model


def parse_upstream_flags(flags: list[str], default_model: str, policy: str,
                         prefill_flags: list[str] | None = None) -> tuple[GroupConfig, ...]:
    """`--upstream [MODEL=]URL`, repeatable: URLs with the same MODEL form one group;
    `--prefill-upstream [MODEL=]URL` adds that group's prefill replicas."""
    prefill = _by_model(prefill_flags or [], default_model)
    unknown = sorted(set(prefill) - set(_by_model(flags, default_model)))
    if unknown:
        raise ConfigError(f"--prefill-upstream for {unknown}: no --upstream serves that model")
    return tuple(GroupConfig(name, tuple(urls), policy, prefill_upstreams=tuple(prefill.get(name, ())))
                 for name, urls in _by_model(flags, default_model).items())


def _group_from_yaml(name: str, spec: dict, default_policy: str) -> GroupConfig:
    if isinstance(spec, list):
        spec = {"upstreams": spec}
    if not isinstance(spec, dict):
        raise ConfigError(f"model group {name!r}: expected a mapping with 'upstreams'")
    unknown = set(spec) - {"upstreams", "policy", "aliases", "fallback", "tokenizer", "prefill_upstreams"}
    if unknown:
        raise ConfigError(f"model group {name!r}: unknown keys {sorted(unknown)}")
    return GroupConfig(name, tuple(spec.get("upstreams") or ()), spec.get("policy", default_policy),
                       tuple(spec.get("aliases") or ()), spec.get("fallback"), spec.get("tokenizer"),
                       tuple(spec.get("prefill_upstreams") or ()))


def load_router_config(path: str | Path | None, upstream_flags: list[str] | None = None, *,
                       default_model: str = "smollm2-135m", policy: str = "least-outstanding-tokens",
                       prefill_flags: list[str] | None = None, **overrides) -> RouterConfig:
    """Groups from the YAML file (`models:` → name → {upstreams, policy, aliases, fallback}) and the
    flags together; top-level YAML keys set RouterConfig fields; keyword overrides win."""
    import yaml

    groups: list[GroupConfig] = []
    settings: dict = {}
    if path is not None:
        try:
            doc = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"{path}: cannot read the router config ({e})") from None
        if not isinstance(doc, dict):
            raise ConfigError(f"{path}: the router config must be a mapping")
        default_policy = doc.get("policy", policy)
        groups += [_group_from_yaml(str(n), s, default_policy) for n, s in (doc.get("models") or {}).items()]
        settings = {k: v for k, v in doc.items() if k not in ("models", "policy")}
        known = set(RouterConfig.__dataclass_fields__) - {"groups"}
        if set(settings) - known:
            raise ConfigError(f"{path}: unknown settings {sorted(set(settings) - known)}")
    groups += parse_upstream_flags(upstream_flags or [], default_model, policy, prefill_flags)
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return RouterConfig(tuple(groups), **(settings | overrides))


__all__ = ["GroupConfig", "RouterConfig", "POLICIES", "load_router_config", "parse_upstream_flags"]


@dataclass(frozen=True)
class GatewayServerConfig:
    """The standalone `ferrylm gateway` process: where it listens, its policy layer, its fleet."""

    router: RouterConfig
    gateway: GatewayConfig | None = None  # auth, limits, quotas, admission, audit
    host: str = "127.0.0.1"
    port: int = 8080
    max_body_bytes: int = 4 << 20
    drain_timeout_s: float = 30.0
    log_level: str = "info"
    connections: ConnectionLimits = ConnectionLimits()  # keep-alive / header timeouts, connection cap
    metrics_require_auth: bool = False  # /metrics (replica URLs in its labels) takes a credential
    tracing: TracingConfig | None = None  # --otlp-traces-endpoint: OpenTelemetry spans over OTLP (None: off)
    tenant_metrics: TenantMetricsConfig = TenantMetricsConfig()  # which tenants get their own latency series

    def __post_init__(self) -> None:
        check_credential_sources(self.metrics_require_auth, None, self.gateway is not None)
