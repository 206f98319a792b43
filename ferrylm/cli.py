"""`ferrylm` command line: generate (offline, streaming to the terminal) and serve."""

from __future__ import annotations

import argparse
import os
import sys
import time


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    from ferrylm.engine_args import add_engine_flags

    add_engine_flags(p)


def engine_config_from_args(args: argparse.Namespace):
    from ferrylm.engine_args import engine_config_from_args as from_args

    return from_args(args)


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate for one prompt, printing text as it is produced."""
    from ferrylm.engine.engine import Engine
    from ferrylm.sampling_params import SamplingParams

    t0 = time.perf_counter()
    engine = Engine.from_config(engine_config_from_args(args))
    print(f"[loaded {args.model} in {time.perf_counter() - t0:.1f}s]", file=sys.stderr)
    prompt = args.prompt
    if args.chat and engine.tokenizer.has_chat_template:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.seed)
    engine.add_request("cli", prompt, params)
    start, first, n = time.perf_counter(), None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            first = first or time.perf_counter()
            n += len(out.outputs[0].token_ids_delta)
            print(out.outputs[0].text_delta, end="", flush=True)
    elapsed = time.perf_counter() - start
    ttft = (first or start) - start
    decode = (n - 1) / max(elapsed - ttft, 1e-9) if n > 1 else 0.0
    print(f"\n[{n} tokens, TTFT {ttft:.2f}s, decode {decode:.1f} tok/s]", file=sys.stderr)
    return 0


def pooler_from_args(args: argparse.Namespace) -> dict:
    """ServerConfig's runner fields from --runner and --pooler-config (vLLM's JSON; pooling types in
    its upper case or ours); what the flag leaves unset comes from a sentence-transformers checkpoint's
    modules.json when --runner pooling serves one, else LAST, normalized."""
    import json
    from pathlib import Path

    from ferrylm.config import ConfigError
    from ferrylm.model.loaders.st_pooling import sentence_transformers_pooling

    pooler: dict = {}
    if args.pooler_config:
        try:
            parsed = json.loads(args.pooler_config)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise ConfigError("--pooler-config must be a JSON object, e.g. '{\"pooling_type\": \"MEAN\"}'")
        pooler = parsed
        unknown = set(pooler) - {"pooling_type", "normalize"}
        if unknown:
            raise ConfigError(f"--pooler-config: {', '.join(sorted(unknown))} not supported (pooling_type, normalize)")
    pooling = args.runner == "pooling"
    # a pooling_type given on the command line overrides the checkpoint's, even one it cannot run itself
    model_dir = Path(args.model).expanduser()
    reads_checkpoint = pooling and model_dir.is_dir() and "pooling_type" not in pooler
    checkpoint = sentence_transformers_pooling(model_dir) if reads_checkpoint else None
    default_type, default_normalize = checkpoint or ("last", True)
    return {"runner": "pooling" if pooling else "generate",
            "pooling_type": str(pooler.get("pooling_type", default_type)).lower(),
            "pooling_normalize": bool(pooler.get("normalize", default_normalize))}


def _add_server_args(p: argparse.ArgumentParser) -> None:
    """ServerConfig's own flags (generated from its `option` fields), then the ones built from several flags
    or nested configs: --served-model-name (falls back to --model), --runner / --pooler-config, and the groups
    `ferrylm gateway` shares."""
    from ferrylm.server.config import add_server_flags

    add_server_flags(p)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use for the model; the first is reported (default: --model)")
    p.add_argument("--runner", choices=["auto", "generate", "pooling"], default="auto",
                   help="pooling: serve POST /v1/embeddings (the prompt's hidden states pooled) instead of "
                        "generation (auto: generate)")
    p.add_argument("--pooler-config", default=None,
                   help='--runner pooling: JSON, e.g. {"pooling_type": "MEAN", "normalize": true} (default: LAST, '
                        "normalized)")
    _add_connection_args(p)
    _add_gateway_policy_args(p)
    _add_observability_args(p)


def _add_observability_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("observability (traces, per-tenant metrics)")
    g.add_argument("--otlp-traces-endpoint", default=None,
                   help="send OpenTelemetry traces over OTLP to this URL (vLLM's flag; protocol from "
                        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: grpc (default) or http/protobuf; OTEL_SERVICE_NAME)")
    g.add_argument("--metrics-tenants", nargs="+", default=(), metavar="TENANT",
                   help="tenants with their own per-tenant latency series; every other tenant is `other`")
    g.add_argument("--max-metrics-tenants", type=int, default=20,
                   help="without --metrics-tenants: the first N tenants seen get a series, later ones `other`")


def observability_from_args(args: argparse.Namespace, service: str):
    """(TracingConfig or None, TenantMetricsConfig) from the flags and the standard OTEL_* variables."""
    from ferrylm.observability.tenant_metrics import TenantMetricsConfig
    from ferrylm.observability.tracing import TracingConfig

    tracing = None
    if args.otlp_traces_endpoint is not None:
        protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        tracing = TracingConfig(args.otlp_traces_endpoint, os.environ.get("OTEL_SERVICE_NAME") or service,
                                protocol or "grpc")
    return tracing, TenantMetricsConfig(tuple(args.metrics_tenants), args.max_metrics_tenants)


def _add_connection_args(p: argparse.ArgumentParser) -> None:
    """Idle and slow clients (uvicorn's names; the defaults are ConnectionLimits')."""
    g = p.add_argument_group("connections (idle and slow clients)")
    g.add_argument("--timeout-keep-alive", type=float, default=15.0,
                   help="seconds an idle keep-alive connection stays open between requests")
    g.add_argument("--timeout-headers", type=float, default=10.0,
                   help="seconds a client may take to send a request's headers; slower ones are closed")
    g.add_argument("--limit-concurrency", type=int, default=1024,
                   help="open connections (or requests in flight) beyond which requests get 503")


def connection_limits_from_args(args: argparse.Namespace):
    from ferrylm.http.config import ConnectionLimits

    return ConnectionLimits(timeout_keep_alive_s=args.timeout_keep_alive, timeout_headers_s=args.timeout_headers,
                            limit_concurrency=args.limit_concurrency)


def _add_gateway_policy_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("gateway (auth, rate limits, quotas, admission control, audit)")
    g.add_argument("--require-auth", action="store_true", help="401 without a valid API key or JWT")
    g.add_argument("--no-gateway", action="store_true", help="no admission control, limits or audit at all")
    g.add_argument("--state-db", default=os.environ.get("FERRYLM_STATE_DB", "sqlite:///ferrylm-state.db"),
                   help="SQLAlchemy URL for tenants, keys, usage and audit")
    g.add_argument("--redis-url", default=None, help="share rate limits between gateway replicas")
    g.add_argument("--rate-limit-failure-mode", choices=("closed", "open"), default="closed",
                   help="when the limit store (Redis) is unreachable: closed = 503 with Retry-After, "
                        "open = admit without the shared limits (logged, counted)")
    g.add_argument("--jwt-secret", default=os.environ.get("FERRYLM_JWT_SECRET"), help="accept HS256 JWTs")
    g.add_argument("--jwt-public-key", default=None, help="PEM file: accept RS256/ES256 JWTs")
    g.add_argument("--jwks-file", default=None, help="JWKS file: accept RS256/ES256 JWTs")
    g.add_argument("--jwt-issuer", default=None)
    g.add_argument("--jwt-audience", default=None)
    g.add_argument("--jwt-tenant-claim", default="tenant")
    g.add_argument("--audit-prompts", action="store_true", help="store prompt text in the audit log")
    g.add_argument("--cached-token-weight", type=float, default=1.0,
                   help="what a prompt token served from the prefix cache weighs in rate limits and daily quotas "
                        "(0..1; 1: like any prompt token)")
    g.add_argument("--shared-prefix-cache", action="store_true",
                   help="let tenants share cached prompt prefixes (default: each tenant's prompts are salted apart, "
                        "so no tenant gets a cache hit, or its timing, from another's prompt)")
    g.add_argument("--no-admission-control", action="store_true",
                   help="never shed on engine load (auth, rate limits and quotas still apply)")
    g.add_argument("--metrics-require-auth", action="store_true",
                   help="/metrics and /load take the /v1 credential (default: open, for Prometheus; they show "
                        "load, and the gateway's metrics name the replica URLs)")


def gateway_config_from_args(args: argparse.Namespace):
    """The GatewayConfig the serve flags describe (None with --no-gateway)."""
    from pathlib import Path

    from ferrylm.gateway.config import GatewayConfig, JWTConfig

    if args.no_gateway:
        return None
    jwt = None
    if args.jwt_secret or args.jwt_public_key or args.jwks_file:
        pem = Path(args.jwt_public_key).read_text() if args.jwt_public_key else None
        jwt = JWTConfig(secret=args.jwt_secret, public_key_pem=pem, jwks_file=args.jwks_file,
                        issuer=args.jwt_issuer, audience=args.jwt_audience, tenant_claim=args.jwt_tenant_claim)
    from ferrylm.gateway.config import AdmissionConfig

    return GatewayConfig(require_auth=args.require_auth, state_db=args.state_db, jwt=jwt, redis_url=args.redis_url,
                         rate_limit_failure_mode=args.rate_limit_failure_mode, audit_prompts=args.audit_prompts,
                         shared_prefix_cache=args.shared_prefix_cache, cached_token_weight=args.cached_token_weight,
                         admission=AdmissionConfig(enabled=not getattr(args, "no_admission_control", False)))


def cmd_serve(args: argparse.Namespace) -> int:
    """Run the OpenAI-compatible HTTP server until SIGTERM (drained) or SIGINT."""
    from ferrylm.config import ConfigError
    from ferrylm.engine.engine import Engine
    from ferrylm.server.config import ServerConfig, server_fields_from_args
    from ferrylm.server.launcher import run_server

    try:
        engine_config = engine_config_from_args(args)
        tracing, tenant_metrics = observability_from_args(args, "ferrylm-serve")
    except ConfigError as e:
        print(f"ferrylm serve: {e}", file=sys.stderr)
        return 2
    if engine_config.tensor_parallel_size > 1:  # under torchrun, ranks 1.. serve rank 0's steps, not HTTP
        from ferrylm.model.parallel.tp_worker import from_torchrun, worker_loop

        place = from_torchrun(engine_config.tensor_parallel_size)
        if place is not None and place.rank > 0:
            worker_loop(engine_config, place)
            return 0
    if engine_config.speculative is not None:  # a draft that cannot work with the model: a usage error now
        from ferrylm.model.spec.draft_setup import check_startup

        try:
            check_startup(engine_config.speculative, engine_config.model)
        except ConfigError as e:
            print(f"ferrylm serve: {e}", file=sys.stderr)
            return 2
    try:
        config = ServerConfig(
            served_model_names=tuple(args.served_model_name or [args.model]),
            test_hooks=os.environ.get("FERRYLM_TEST_HOOKS") == "1", gateway=gateway_config_from_args(args),
            metrics_require_auth=args.metrics_require_auth, connections=connection_limits_from_args(args),
            tracing=tracing, tenant_metrics=tenant_metrics, tensor_parallel_size=engine_config.tensor_parallel_size,
            enable_lora=engine_config.lora.enable_lora, **server_fields_from_args(args),
            **pooler_from_args(args))
    except ConfigError as e:
        print(f"ferrylm serve: {e}", file=sys.stderr)
        return 2
    return run_server(config, lambda: Engine.from_config(engine_config))


def _add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (0: any free port)")
    p.add_argument("--upstream", action="append", default=[], metavar="[MODEL=]URL",
                   help="a FerryLM replica; repeat for more (URLs with the same MODEL form one group)")
    p.add_argument("--router-config", default=None, help="YAML: models → upstreams, policy, aliases, fallback")
    p.add_argument("--prefill-upstream", action="append", default=[], metavar="[MODEL=]URL",
                   help="with --policy disaggregated: a replica started with --kv-role prefill; each prompt is "
                        "prefilled there and its KV blocks moved to the --upstream replica chosen (--kv-role decode)")
    p.add_argument("--model", default="smollm2-135m", help="model name for --upstream URLs given without MODEL=")
    p.add_argument("--policy", default="least-outstanding-tokens",
                   choices=["round-robin", "least-outstanding-tokens", "prefix-affinity", "latency", "disaggregated"])
    p.add_argument("--upstream-api-key", default=os.environ.get("FERRYLM_UPSTREAM_API_KEY"),
                   help="Bearer key the replicas require (their --api-key)")
    p.add_argument("--kv-transfer-key", default=os.environ.get("FERRYLM_KV_TRANSFER_KEY"),
                   help="with --policy disaggregated: the replicas' --kv-transfer-key, sent only to their KV routes")
    p.add_argument("--max-attempts", type=int, default=None, help="tries per request before the first token")
    p.add_argument("--poll-interval", type=float, default=None, help="seconds between /ready polls")
    p.add_argument("--expose-upstream-header", action="store_true", default=None,
                   help="name the replica that answered in an X-FerryLM-Upstream response header (debugging)")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20)
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    _add_connection_args(p)
    _add_gateway_policy_args(p)
    _add_observability_args(p)


def cmd_gateway(args: argparse.Namespace) -> int:
    """Serve the OpenAI API in front of remote FerryLM replicas."""
    from ferrylm.config import ConfigError
    from ferrylm.router.config import GatewayServerConfig, load_router_config
    from ferrylm.router.launcher import run_gateway

    try:
        router = load_router_config(args.router_config, args.upstream, default_model=args.model, policy=args.policy,
                                    prefill_flags=args.prefill_upstream,
                                    upstream_api_key=args.upstream_api_key, max_attempts=args.max_attempts,
                                    kv_transfer_key=args.kv_transfer_key,
                                    poll_interval_s=args.poll_interval, expose_upstream=args.expose_upstream_header)
        connections = connection_limits_from_args(args)
        tracing, tenant_metrics = observability_from_args(args, "ferrylm-gateway")
    except ConfigError as e:
        print(f"ferrylm gateway: {e}", file=sys.stderr)
        return 2
    config = GatewayServerConfig(router=router, gateway=gateway_config_from_args(args), host=args.host,
                                 port=args.port, max_body_bytes=args.max_body_bytes,
                                 drain_timeout_s=args.drain_timeout, log_level=args.log_level,
                                 metrics_require_auth=args.metrics_require_auth, connections=connections,
                                 tracing=tracing, tenant_metrics=tenant_metrics)
    return run_gateway(config)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ferrylm", description="FerryLM: self-hosted LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt")
    _add_engine_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                     help="wrap the prompt in the model's chat template (default on)")
    gen.set_defaults(func=cmd_generate)
    serve = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    _add_engine_args(serve)
    _add_server_args(serve)
    serve.set_defaults(func=cmd_serve)
    gateway = sub.add_parser("gateway", help="serve the OpenAI API in front of remote FerryLM replicas")
    _add_router_args(gateway)
    gateway.set_defaults(func=cmd_gateway)
    from ferrylm.gateway.cli import add_gateway_commands

    add_gateway_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
