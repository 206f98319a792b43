"""Gateway settings: one frozen GatewayConfig composed of the sub-configs its parts receive."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ferrylm.config import ConfigError

DEFAULT_STATE_DB = "sqlite:///ferrylm-state.db"
_HMAC_ALGORITHMS = frozenset({"HS256", "HS384", "HS512"})
_ASYMMETRIC_ALGORITHMS = frozenset({"RS256", "RS384", "RS512", "PS256", "PS384", "PS512",
                                    "ES256", "ES384", "ES512", "EdDSA"})


def _frozen_map(values: Mapping) -> Mapping:
    """A read-only copy, so a frozen config cannot be changed through its maps either."""
    return MappingProxyType(dict(values))


@dataclass(frozen=True)
class JWTConfig:
    """How bearer JWTs are verified. Only `algorithms` are accepted; HS* use `secret`, the
    asymmetric ones use `public_key_pem` or the keys of `jwks_file` (never the other way round)."""

    secret: str | None = None
    public_key_pem: str | None = None
    jwks_file: str | None = None
    algorithms: tuple[str, ...] = ()  # empty: HS256 with a secret, RS256+ES256 with public keys
    issuer: str | None = None
    audience: str | None = None
    tenant_claim: str = "tenant"
    leeway_s: float = 0.0

    def __post_init__(self) -> None:
        if not (self.secret or self.public_key_pem or self.jwks_file):
            raise ConfigError("JWT auth needs a secret, a public key PEM or a JWKS file")
        if self.public_key_pem and self.jwks_file:
            raise ConfigError("give either a public key PEM or a JWKS file, not both")
        algorithms = self.algorithms or self._default_algorithms()
        object.__setattr__(self, "algorithms", tuple(algorithms))
        for alg in self.algorithms:
            if alg not in _HMAC_ALGORITHMS | _ASYMMETRIC_ALGORITHMS:
                raise ConfigError(f"JWT algorithm {alg!r} is not accepted")
            if alg in _HMAC_ALGORITHMS and not self.secret:
                raise ConfigError(f"JWT algorithm {alg} needs a secret")
            if alg in _ASYMMETRIC_ALGORITHMS and not (self.public_key_pem or self.jwks_file):
                raise ConfigError(f"JWT algorithm {alg} needs a public key PEM or a JWKS file")
        if self.leeway_s < 0:
            raise ConfigError("leeway_s must be >= 0")

    def _default_algorithms(self) -> tuple[str, ...]:
        algorithms: tuple[str, ...] = ("HS256",) if self.secret else ()
        if self.public_key_pem or self.jwks_file:
            algorithms += ("RS256", "ES256")
        return algorithms

    @staticmethod
    def is_hmac(alg: str) -> bool:
        return alg in _HMAC_ALGORITHMS


@dataclass(frozen=True)
class AdmissionConfig:
    """Load shedding: tiers map to scheduler priorities (lower runs first) and to the queue wait
    they tolerate. A lower budget sheds a tier earlier, so batch goes before premium."""

    tier_priorities: Mapping[str, int] = field(
        default_factory=lambda: {"premium": 0, "standard": 1, "batch": 2})
    tier_wait_budgets_s: Mapping[str, float] = field(
        default_factory=lambda: {"premium": 30.0, "standard": 10.0, "batch": 2.0})
    default_tier: str = "standard"  # for tenants whose tier is in neither map, and anonymous callers
    kv_watermark: float = 0.95  # above it, queued work also waits for running requests to finish
    max_num_waiting: int | None = None  # a hard queue-length cap on top of the projected wait
    unhealthy_retry_after_s: float = 5.0
    default_completion_tokens: int = 128  # prior for the mean completion length
    enabled: bool = True  # False: never shed on load (auth, limits and quotas still apply)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tier_priorities", _frozen_map(self.tier_priorities))
        object.__setattr__(self, "tier_wait_budgets_s", _frozen_map(self.tier_wait_budgets_s))
        if self.default_tier not in self.tier_priorities or self.default_tier not in self.tier_wait_budgets_s:
            raise ConfigError(f"default tier {self.default_tier!r} needs a priority and a wait budget")
        if any(b <= 0 for b in self.tier_wait_budgets_s.values()):
            raise ConfigError("tier wait budgets must be positive")
        if not 0 < self.kv_watermark <= 1:
            raise ConfigError("kv_watermark must be in (0, 1]")
        if self.max_num_waiting is not None and self.max_num_waiting < 1:
            raise ConfigError("max_num_waiting must be positive (None: no cap)")

    def priority(self, tier: str) -> int:
        return self.tier_priorities.get(tier, self.tier_priorities[self.default_tier])

    def wait_budget_s(self, tier: str) -> float:
        return self.tier_wait_budgets_s.get(tier, self.tier_wait_budgets_s[self.default_tier])


@dataclass(frozen=True)
class GatewayConfig:
    """Policy in front of the engine: who may call (auth), how much (limits, quotas), and whether
    the engine can take more right now (admission). require_auth=False admits everyone as the
    anonymous tenant with no limits, which keeps a plain `ferrylm serve` open as before."""

    require_auth: bool = False
    state_db: str = DEFAULT_STATE_DB  # any SQLAlchemy URL; postgresql://... works unchanged
    jwt: JWTConfig | None = None
    redis_url: str | None = None  # None: rate limits live in this process only
    redis_key_prefix: str = "ferrylm:rl:"
    # When the limit store (Redis) cannot be reached: "closed" answers 503 + Retry-After (no request
    # runs unmetered), "open" admits without the shared limits (serving beats metering). Never a 500.
    rate_limit_failure_mode: str = "closed"
    audit_prompts: bool = False  # store prompt text in the audit log (off: counts only)
    audit_rejections: bool = True  # audit 403/429/503 answers to known tenants too
    anonymous_tenant: str = "anonymous"
    # False: each tenant's prompts are salted apart in the prefix cache (cache_salt.py); True: tenants
    # share cached prefixes (hits across tenants, and the timing signal that comes with them)
    shared_prefix_cache: bool = False
    # how much a prompt token served from the prefix cache weighs in rate limits and daily quotas
    # (1.0: like any prompt token; OpenAI prices cached input at 0.1-0.5 of the uncached price)
    cached_token_weight: float = 1.0
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)

    def __post_init__(self) -> None:
        if not 0.0 <= self.cached_token_weight <= 1.0:
            raise ConfigError("cached_token_weight must be in [0, 1]")
        if not self.state_db:
            raise ConfigError("state_db must be a SQLAlchemy URL")
        if self.rate_limit_failure_mode not in ("open", "closed"):
            raise ConfigError("rate_limit_failure_mode must be 'open' or 'closed'")

    def billed_tokens(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> int:
        """Tokens a request charges against rate limits and the daily quota: cached prompt tokens
        weigh `cached_token_weight` (rounded up, so a positive weight never charges nothing)."""
        return prompt_tokens - cached_tokens + math.ceil(cached_tokens * self.cached_token_weight) + completion_tokens
