"""ServerConfig: how the HTTP front end listens, authenticates, bounds requests and shuts down."""

from __future__ import annotations

from dataclasses import dataclass

from ferrylm.config import ConfigError
from ferrylm.gateway.config import GatewayConfig
from ferrylm.gateway.ops_auth import check_credential_sources
from ferrylm.http.config import ConnectionLimits
from ferrylm.observability.tenant_metrics import TenantMetricsConfig
from ferrylm.observability.tracing import TracingConfig
from ferrylm.server.reasoning import REASONING_PARSERS


@dataclass(frozen=True)
class ServerConfig:
    """Settings of the OpenAI-compatible server (the engine's live in EngineConfig)."""

    served_model_names: tuple[str, ...] = ("smollm2-135m",)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_body_bytes: int = 4 << 20  # larger bodies get 413 before they are parsed
    max_sequences_per_request: int = 256  # prompts × n per API request (each is an engine request)
    max_stream_backlog: int = 4096  # outputs a stream may have waiting for a slow reader before it is aborted
    drain_timeout_s: float = 30.0  # SIGTERM: how long in-flight requests may take to finish
    ready_timeout_s: float = 5.0  # /ready: how long the one-token probe may take
    heartbeat_timeout_s: float = 30.0  # /health: an engine loop silent for longer is wedged
    test_hooks: bool = False  # expose /debug/* (env FERRYLM_TEST_HOOKS=1); never in production
    log_level: str = "info"
    gateway: GatewayConfig | None = None  # auth, rate limits, quotas, admission control, audit
    metrics_require_auth: bool = False  # /metrics and /load take /v1's credential (default: open)
    connections: ConnectionLimits = ConnectionLimits()  # keep-alive / header timeouts, connection cap
    kv_role: str | None = None  # --kv-role: prefill (serves /v1/kv/export), decode (/v1/kv/import), both
    max_kv_transfer_bytes: int = 1 << 30  # a /v1/kv/import body larger than this gets 413
    kv_transfer_key: str | None = None  # --kv-transfer-key: the only credential the KV routes take
    tracing: TracingConfig | None = None  # --otlp-traces-endpoint: OpenTelemetry spans over OTLP (None: off)
    tenant_metrics: TenantMetricsConfig = TenantMetricsConfig()  # which tenants get their own latency series
    tensor_parallel_size: int = 1  # devices the engine uses: tokens_per_second_per_device divides by it
    reasoning_parser: str | None = None  # --reasoning-parser (vLLM's): deepseek_r1 | qwen3 (server/reasoning.py)
    runner: str = "generate"  # --runner (vLLM's): generate, or pooling (POST /v1/embeddings only)
    pooling_type: str = "last"  # --pooler-config's pooling_type: last | mean | cls
    pooling_normalize: bool = True  # --pooler-config's normalize: L2-normalise the vectors
    enable_lora: bool = False  # the engine's --enable-lora (adapters are served by name)
    lora_modules: tuple[tuple[str, str], ...] = ()  # --lora-modules: (name, peft directory) loaded at start-up
    lora_admin_key: str | None = None  # --lora-admin-key: the only credential the load/unload routes take

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ConfigError("at least one served model name is needed")
        check_credential_sources(self.metrics_require_auth, self.api_key, self.gateway is not None)
        if min(self.max_sequences_per_request, self.max_stream_backlog) < 1:
            raise ConfigError("max_sequences_per_request and max_stream_backlog must be at least 1")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ConfigError(f"--reasoning-parser {self.reasoning_parser!r} is not supported; choose one of "
                              f"{', '.join(REASONING_PARSERS)}")
        if self.runner not in ("generate", "pooling"):
            raise ConfigError(f"--runner must be generate or pooling, not {self.runner!r}")
        if self.pooling_type not in ("last", "mean", "cls"):
            raise ConfigError(f"--pooler-config pooling_type must be last, mean or cls, not {self.pooling_type!r}")
        if self.kv_role not in (None, "prefill", "decode", "both"):
            raise ConfigError(f"--kv-role must be prefill, decode or both, not {self.kv_role!r}")
        if self.kv_role is not None and not self.kv_transfer_key:
            raise ConfigError("--kv-role needs --kv-transfer-key (env FERRYLM_KV_TRANSFER_KEY): KV transfer is a "
                              "replica-to-replica API that API and tenant keys cannot reach")
        if self.kv_transfer_key is not None and (len(self.kv_transfer_key) < 16
                                                 or self.kv_transfer_key == self.api_key):
            raise ConfigError("--kv-transfer-key must be at least 16 characters and differ from --api-key")
        if (self.lora_modules or self.lora_admin_key) and not self.enable_lora:
            raise ConfigError("--lora-modules and --lora-admin-key need --enable-lora")
        if self.lora_admin_key is not None and (len(self.lora_admin_key) < 16 or self.lora_admin_key in (
                self.api_key, self.kv_transfer_key)):
            raise ConfigError("--lora-admin-key must be at least 16 characters and differ from --api-key and "
                              "--kv-transfer-key")
        clash = sorted({name for name, _ in self.lora_modules} & set(self.served_model_names))
        if clash:
            raise ConfigError(f"--lora-modules names {clash} are also served model names")
        if self.max_kv_transfer_bytes < 1024:
            raise ConfigError("--max-kv-transfer-bytes must be at least 1024")
        if self.max_body_bytes < 1024:
            raise ConfigError("max_body_bytes must be at least 1024")
        if min(self.drain_timeout_s, self.ready_timeout_s, self.heartbeat_timeout_s) <= 0:
            raise ConfigError("timeouts must be positive")

    @property
    def model_name(self) -> str:
        """The name responses and metrics report (the first served name, as vLLM does)."""
        return self.served_model_names[0]


def parse_lora_modules(values: list[str]) -> tuple[tuple[str, str], ...]:
    """--lora-modules: NAME=PATH or vLLM's JSON object {"name": ..., "path": ...} each."""
    import json

    modules = []
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                item = json.loads(value)
                name, path = item["name"], item["path"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ConfigError(f"--lora-modules {value!r}: JSON needs \"name\" and \"path\"") from None
        else:
            name, sep, path = value.partition("=")
            if not sep:
                raise ConfigError(f"--lora-modules {value!r}: expected NAME=PATH")
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            raise ConfigError(f"--lora-modules {value!r}: NAME and PATH must be non-empty")
        modules.append((name, path))
    names = [name for name, _ in modules]
    if len(set(names)) != len(names):
        raise ConfigError("--lora-modules names must be unique")
    return tuple(modules)
