"""ServerConfig: how the HTTP front end listens, authenticates, bounds requests and shuts down."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ferrylm.config import ConfigError, option
from ferrylm.config_flags import ConfigFlag, add_flags, config_flags, field_value, flags_markdown, values_from_args
from ferrylm.gateway.config import GatewayConfig
from ferrylm.gateway.ops_auth import check_credential_sources
from ferrylm.http.config import ConnectionLimits
from ferrylm.observability.tenant_metrics import TenantMetricsConfig
from ferrylm.observability.tracing import TracingConfig
from ferrylm.server.reasoning import REASONING_PARSERS


def parse_structured_outputs_config(text: str) -> str:
    """--structured-outputs-config: a JSON object whose only key is enable_in_reasoning (a boolean);
    anything else is refused, naming it, rather than ignored."""
    import json

    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise ConfigError('--structured-outputs-config must be a JSON object, e.g. \'{"enable_in_reasoning": true}\'')
    unknown = sorted(set(parsed) - {"enable_in_reasoning"})
    if unknown:
        raise ConfigError(f"--structured-outputs-config: {', '.join(unknown)} not supported (enable_in_reasoning)")
    if not isinstance(parsed.get("enable_in_reasoning", False), bool):
        raise ConfigError("--structured-outputs-config: enable_in_reasoning must be true or false")
    return json.dumps(parsed, sort_keys=True)


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


@dataclass(frozen=True)
class ServerConfig:
    """Settings of the OpenAI-compatible server (the engine's live in EngineConfig). A field declared with
    `option(...)` is a `ferrylm serve` flag (server_flags below); the others cli.py builds from several
    flags, nested configs or the engine's config."""

    served_model_names: tuple[str, ...] = ("smollm2-135m",)
    host: str = option("127.0.0.1", "address to listen on (0.0.0.0: every interface)")
    port: int = option(8000, "port to listen on (0: any free port)")
    api_key: str | None = option(None, "require 'Authorization: Bearer KEY' on /v1 routes", env="FERRYLM_API_KEY")
    # bodies are refused before they are parsed
    max_body_bytes: int = option(4 << 20, "larger request bodies get 413")
    max_sequences_per_request: int = option(
        256, "most prompts x n one API request may ask for (each is an engine request); more get 400")
    max_stream_backlog: int = option(
        4096, "outputs a stream may have waiting for a slow reader; past it the request is aborted")
    drain_timeout_s: float = option(30.0, "seconds in-flight requests may take to finish after SIGTERM",
                                    name="drain_timeout")
    ready_timeout_s: float = option(5.0, "seconds /ready's one-token probe may take", name="ready_timeout")
    # an engine loop silent for longer is wedged
    heartbeat_timeout_s: float = option(30.0, "/health fails when the engine loop has been silent this long",
                                        name="heartbeat_timeout")
    test_hooks: bool = False  # expose /debug/* (env FERRYLM_TEST_HOOKS=1); never in production
    log_level: str = option("info", "the server's log level (JSON lines)",
                            choices=("debug", "info", "warning", "error"))
    gateway: GatewayConfig | None = None  # auth, rate limits, quotas, admission control, audit
    metrics_require_auth: bool = False  # /metrics and /load take /v1's credential (default: open)
    connections: ConnectionLimits = ConnectionLimits()  # keep-alive / header timeouts, connection cap
    kv_role: str | None = option(
        None, "disaggregated prefill/decode: serve POST /v1/kv/export (prefill), /v1/kv/import (decode) or both; "
              "KV blocks move by block hash into the decode replica's prefix cache",
        choices=("prefill", "decode", "both"))
    max_kv_transfer_bytes: int = option(
        1 << 30, "a POST /v1/kv/import body larger than this gets 413 (a 4k-token SmolLM2 prompt is ~94 MB)")
    # the only credential the KV routes take
    kv_transfer_key: str | None = option(
        None, "with --kv-role: the replica-to-replica secret the KV routes require (the gateway's "
              "--kv-transfer-key); API and tenant keys get 403 there", env="FERRYLM_KV_TRANSFER_KEY")
    tracing: TracingConfig | None = None  # --otlp-traces-endpoint: OpenTelemetry spans over OTLP (None: off)
    tenant_metrics: TenantMetricsConfig = TenantMetricsConfig()  # which tenants get their own latency series
    tensor_parallel_size: int = 1  # devices the engine uses: tokens_per_second_per_device divides by it
    reasoning_parser: str | None = option(  # vLLM's flag; the parsers are in server/reasoning.py
        None, "split a reasoning model's <think>...</think> from its answer: chat's message.reasoning (and "
              "reasoning_content), Responses' reasoning item, Messages' thinking block", choices=REASONING_PARSERS)
    structured_outputs_config: str | None = option(  # vLLM's flag, with the one key we honour
        None, 'JSON; {"enable_in_reasoning": true} applies a structured-output constraint (or a forced tool call) '
              "to a reasoning model's thinking too (default: to the answer only, after </think>)",
        parse=lambda text: parse_structured_outputs_config(text), metavar="JSON")
    runner: str = "generate"  # --runner (vLLM's): generate, or pooling (POST /v1/embeddings only)
    pooling_type: str = "last"  # --pooler-config's pooling_type: last | mean | cls
    pooling_normalize: bool = True  # --pooler-config's normalize: L2-normalise the vectors
    enable_lora: bool = False  # the engine's --enable-lora (adapters are served by name)
    lora_modules: tuple[tuple[str, str], ...] = option(  # (name, peft directory) each
        (), "with --enable-lora: peft adapters loaded at start-up, each served under its NAME (a request's "
            '"model"); NAME=PATH or vLLM\'s JSON {"name": ..., "path": ...}',
        nargs="+", metavar="NAME=PATH", parse=parse_lora_modules)
    # the only credential the load/unload routes take
    lora_admin_key: str | None = option(
        None, "with --enable-lora: the secret POST /v1/load_lora_adapter and /v1/unload_lora_adapter require "
              "(off without it); API and tenant keys get 403 there", env="FERRYLM_LORA_ADMIN_KEY")

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
        if self.structured_outputs_config is not None:
            parse_structured_outputs_config(self.structured_outputs_config)
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

    @property
    def constrain_reasoning(self) -> bool:
        """--structured-outputs-config's enable_in_reasoning: constraints apply to the thinking too."""
        import json

        return bool(self.structured_outputs_config and json.loads(self.structured_outputs_config).get(
            "enable_in_reasoning"))


def server_flags() -> Iterator[ConfigFlag]:
    """ServerConfig's fields under their flag keywords; those with `is_flag` are `ferrylm serve` flags."""
    return config_flags(((None, ServerConfig),))


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per `option` field of ServerConfig, with its default, help and environment fallback."""
    add_flags(parser, server_flags())


def server_fields_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The flags add_server_flags declared, as ServerConfig keywords (a bad --lora-modules is a ConfigError)."""
    flags = {flag.keyword: flag for flag in server_flags() if flag.is_flag}
    return {flags[keyword].field.name: field_value(flags[keyword], value)
            for keyword, value in values_from_args(args, flags.values()).items()}


def server_flags_markdown() -> str:
    """The server flags as docs/serving.md's table (a test keeps the page equal to this)."""
    return flags_markdown(server_flags())


if __name__ == "__main__":
    print(server_flags_markdown(), end="")
