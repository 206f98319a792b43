"""`ferrylm gateway`: the OpenAI API in front of remote FerryLM replicas. Per request: validate,
count tokens, gateway policy (auth, limits, quotas, admission from the replicas' load), route,
proxy (SSE unbuffered), settle. Handlers stay thin; the parts live in this package."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ferrylm.gateway.auth import Principal, check_model
from ferrylm.gateway.cache_salt import effective_cache_salt
from ferrylm.gateway.ops_auth import require_credential
from ferrylm.gateway.policy import Admission
from ferrylm.gateway.rate_limit import RateLimitResult
from ferrylm.gateway.reservation import reserved_tokens
from ferrylm.http import messages_protocol
from ferrylm.http.disconnect import SSE_HEADERS, ClientDisconnected, SSEResponse, cancel_on_disconnect
from ferrylm.http.drain import DrainController
from ferrylm.http.embeddings_protocol import EmbeddingRequest, as_completion_request
from ferrylm.http.error_handlers import install_error_handlers
from ferrylm.http.errors import APIError, model_not_found, parse_model
from ferrylm.http.messages_protocol import MessagesRequest
from ferrylm.http.middleware import RequestIdMiddleware, new_request_id
from ferrylm.http.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    VersionResponse,
)
from ferrylm.http.responses_protocol import ResponsesRequest, as_chat_request
from ferrylm.http.settlement import Settlement
from ferrylm.load_report import LoadReport
from ferrylm.observability.dashboard.readings import gateway_reader
from ferrylm.observability.dashboard.routes import dashboard_router
from ferrylm.observability.dashboard.sampler import DashboardSampler
from ferrylm.observability.tracing import Tracing
from ferrylm.outputs import Usage
from ferrylm.router import prompt_info
from ferrylm.router.config import GatewayServerConfig
from ferrylm.router.dispatch import Dispatcher
from ferrylm.router.inflight import InFlight
from ferrylm.router.metrics import PREFIX as ROUTER_PREFIX
from ferrylm.router.metrics import RouterMetrics
from ferrylm.router.observation import GatewayObservation
from ferrylm.router.policies import RouteContext
from ferrylm.router.poller import HealthPoller
from ferrylm.router.proxied_end import ProxiedRequestEnd
from ferrylm.router.registry import ModelGroup, ReplicaRegistry
from ferrylm.router.relay import StreamRelay
from ferrylm.router.request_body import read_request_body
from ferrylm.router.sse import usage_counts
from ferrylm.sampling_params import SamplingParamsError, check_cache_salt
from ferrylm.version import package_version

log = logging.getLogger("ferrylm.gateway")
TRACE_HEADERS = ("traceparent", "tracestate", "baggage")
PASSED_HEADERS = ("retry-after", "retry-after-ms", "www-authenticate")  # from a replica's whole answer


class GatewayState:
    """Everything one gateway process owns: registry, poller, HTTP client, policy layer, metrics."""

    def __init__(self, config: GatewayServerConfig, span_exporter: Any = None):
        self.config = config
        self.registry = ReplicaRegistry(config.router)
        self.metrics = RouterMetrics(self.registry, config.tenant_metrics)
        self.tracing = Tracing.create(config.tracing, span_exporter)  # None: tracing off
        ttft = ROUTER_PREFIX + "time_to_first_token_seconds"
        self.dashboard = DashboardSampler(
            gateway_reader(self.registry.replicas, self.metrics.registry, ttft), "gateway",
            notes={"itl": "not measured by the gateway: each replica's /dashboard shows it"})
        self.drain = DrainController()
        self.fatal = asyncio.Event()
        self.gateway = None
        if config.gateway is not None:
            from ferrylm.gateway.policy import Gateway
            from ferrylm.observability.metrics import RATE_LIMITER_FAILURES, ReadCounter

            gateway = self.gateway = Gateway(config.gateway)
            self.metrics.registry.register(ReadCounter(*RATE_LIMITER_FAILURES, lambda: gateway.limiter_failures))
        self.client: httpx.AsyncClient | None = None
        self.dispatcher: Dispatcher | None = None
        self.poller: HealthPoller | None = None
        self.tokenizers_loaded = False  # /ready waits for them: prefix affinity needs exact hashes

    @asynccontextmanager
    async def lifespan(self, _app: FastAPI) -> AsyncIterator[None]:
        r = self.config.router
        timeout = httpx.Timeout(r.first_byte_timeout_s, connect=r.connect_timeout_s)
        # Idle upstream connections expire well before the replicas' keep-alive timeout, so the
        # gateway never sends on a connection the replica is closing.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=2.0)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits)
        self.dispatcher = Dispatcher(self.registry, r, self.client, self.metrics)
        self.poller = HealthPoller(self.registry, r, self.client)
        await self.poller.poll_once()
        self.poller.start()
        self.dashboard.start()
        tokenizers = asyncio.create_task(self._load_tokenizers())
        try:
            yield
        finally:
            tokenizers.cancel()
            await self.dashboard.stop()
            await self.poller.stop()
            await self.client.aclose()
            if self.gateway is not None:
                self.gateway.close()
            if self.tracing is not None:
                await asyncio.to_thread(self.tracing.shutdown)  # flushes the spans still queued

    async def _load_tokenizers(self) -> None:
        for group in self.registry.groups.values():
            source = group.config.tokenizer or group.name
            try:
                group.tokenizer = await asyncio.to_thread(prompt_info.load_tokenizer, source)
            except Exception as e:  # noqa: BLE001 - no tokenizer: estimate token counts from text
                group.tokenizer_error = str(e)
                log.warning("no tokenizer for model group; token counts are estimated",
                            extra={"model_group": group.name, "error": str(e)})
        self.tokenizers_loaded = True

    def group_load(self, group: ModelGroup) -> LoadReport | None:
        """The group's ready replicas' load reports as one engine's (admission control reads it);
        healthy while the group or a fallback can serve, whatever the replicas last said."""
        loads = [r.load for r in group.replicas if r.load is not None and r.ready]
        healthy = any(g.available() for g in self.registry.fallback_chain(group))
        if not loads:
            return None if healthy else LoadReport.empty(healthy=False)
        return dataclasses.replace(LoadReport.combine(loads), healthy=healthy)


def _state(request: Request) -> GatewayState:
    return request.app.state.ferry


async def kv_refused(request: Request, rest: str) -> Response:
    """KV transfer is never a tenant route: the gateway sends it only between replicas itself."""
    raise APIError(403, "KV transfer is an internal replica-to-replica API; it is not served to clients.",
                   code="permission_denied", type_="invalid_request_error")


def _upstream_headers(request: Request, request_id: str, api_key: str | None) -> dict[str, str]:
    headers = {"X-Request-Id": request_id}
    headers |= {name: request.headers[name] for name in TRACE_HEADERS if name in request.headers}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def _upstream_body(body: dict, req: ChatCompletionRequest | CompletionRequest, priority: int | None,
                   responses: bool, cache_salt: str | None) -> dict:
    """The client's body as sent, with the cache salt the gateway chose for its tenant; chat and
    completion streams always ask for usage (the relay drops it if unasked; a Responses stream
    always ends with it)."""
    out = {k: v for k, v in body.items() if k != "cache_salt"}
    if cache_salt is not None:
        out["cache_salt"] = cache_salt
    if req.stream and not responses:
        out["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    if priority is not None:
        out["priority"] = priority
    return out


def _cache_salt(state: GatewayState, principal, body: dict) -> str | None:
    """The salt the replicas hash this request's prompt with: the tenant's own namespace unless the
    deployment shares its prefix cache (gateway/cache_salt.py); a malformed `cache_salt` is a 400."""
    requested = body.get("cache_salt")
    try:
        check_cache_salt(requested)
    except SamplingParamsError as e:
        raise APIError(400, f"Invalid 'cache_salt': {e}.", "cache_salt") from None
    if state.gateway is None:
        return requested
    return effective_cache_salt(principal, requested, state.gateway.config.shared_prefix_cache)


async def _route_context(state: GatewayState, group: ModelGroup, req: ChatCompletionRequest | CompletionRequest,
                         cache_salt: str | None = None, session_id: str | None = None) -> RouteContext:
    """Token counts (for limits, admission and outstanding tokens) and prefix hashes (for affinity)."""
    block_size = group.upstream_block_size()
    try:
        info = await asyncio.to_thread(prompt_info.describe, group.tokenizer, block_size, req, cache_salt)
    except ValueError as e:
        raise APIError(400, str(e)) from None
    n = req.n or 1
    # What the replica's engine will allow, as `ferrylm serve` reserves it: without max_tokens,
    # the rest of the replicas' context window (the router default only until /load reports it).
    max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
    reserved = reserved_tokens(info.prompt_lens, n, max_tokens, group.upstream_max_model_len(),
                               state.config.router.default_max_tokens)
    echo_chunks = n * len(info.prompt_lens) if getattr(req, "echo", False) else 0
    return RouteContext(reserved.prompt_tokens, reserved.output_tokens, info.hashes, info.key,
                        block_size or prompt_info.DEFAULT_BLOCK_SIZE, echo_chunks, n * len(info.prompt_lens),
                        Usage.of(info.prompt_lens, 0).prompt_tokens,
                        info.token_ids if group.config.prefill_upstreams else (), cache_salt,
                        req.model if state.registry.is_adapter(req.model) else None,
                        _session(session_id or getattr(req, "user", None), cache_salt))


def _session(session_id: str | None, cache_salt: str | None) -> str | None:
    """The routing key of an agent session: X-Session-Id, else the body's `user`, under the tenant's
    cache salt (one tenant's session ids never steer another's requests)."""
    if not isinstance(session_id, str) or not session_id:
        return None
    return f"{cache_salt or ''}\0{session_id[:256]}"


RequestModel = (type[ChatCompletionRequest] | type[CompletionRequest] | type[ResponsesRequest] | type[MessagesRequest]
                | type[EmbeddingRequest])


def _parse_request(model_cls: RequestModel, body: dict) -> ChatCompletionRequest | CompletionRequest:
    """The request as the replica will run it: a Responses request counts, routes and is
    validated as the chat request it becomes there (its errors name the Responses fields)."""
    req = parse_model(model_cls, body)
    if isinstance(req, EmbeddingRequest):
        return as_completion_request(req)
    if isinstance(req, MessagesRequest):
        return messages_protocol.as_chat_request(req)
    return as_chat_request(req) if isinstance(req, ResponsesRequest) else req


async def _proxy(request: Request, model_cls: RequestModel, path: str, prefix: str) -> Response:
    state = _state(request)
    state.drain.check_admitting()
    waiting = InFlight()
    state.drain.add(waiting)  # from here the SIGTERM drain waits for this request
    try:
        return await _proxy_admitted(request, state, model_cls, path, prefix, waiting)
    finally:
        state.drain.discard(waiting)


@dataclass(frozen=True)
class _Admitted:
    """A generation request past the gateway's policy, ready to dispatch."""

    req: ChatCompletionRequest | CompletionRequest  # as the replica runs it
    body: dict  # as the client sent it
    group: ModelGroup
    ctx: RouteContext
    cache_salt: str | None
    request_id: str
    admission: Admission | None


async def _identify(request: Request, state: GatewayState) -> tuple[Principal, RateLimitResult] | None:
    """Who is calling and one request off their requests/min, before the body is read or
    tokenized (as `ferrylm serve`); None without a gateway policy."""
    if state.gateway is None:
        return None
    return await state.gateway.identify(request.headers, request.client.host if request.client else None)


def _group(state: GatewayState, model: str | None) -> ModelGroup:
    """The model group serving `model`, or 404 model_not_found."""
    group = state.registry.resolve(model)
    if group is None:
        raise model_not_found(model)
    return group


async def _admit(request: Request, state: GatewayState, model_cls: RequestModel, prefix: str) -> _Admitted:
    """Authenticate and charge, read and parse the body, count its tokens, admit it (401, 429, 413,
    400, 404, 403, 503 in the order a client sees them)."""
    caller = await _identify(request, state)
    principal, charge = caller if caller is not None else (None, None)
    body = await read_request_body(request, state.config.max_body_bytes)
    req = _parse_request(model_cls, body)
    group = _group(state, req.model)
    request.state.request_id = request_id = request.state.request_id or new_request_id(prefix)
    salt = _cache_salt(state, principal, body)
    ctx = await _route_context(state, group, req, salt, request.headers.get("x-session-id"))
    admission = None
    if state.gateway is not None:
        client = request.client.host if request.client else None
        # a LoRA adapter is allowed by its own name in a tenant's model list; anything else by its group's
        admission = await state.gateway.admit(request.headers, client, ctx.adapter or group.name, ctx.prompt_tokens,
                                              ctx.expected_output, state.group_load(group), request_id=request_id,
                                              principal=principal, num_sequences=ctx.num_sequences,
                                              request_charge=charge)
    return _Admitted(req, body, group, ctx, salt, request_id, admission)


async def _proxy_admitted(request: Request, state: GatewayState, model_cls: RequestModel, path: str, prefix: str,
                          waiting: InFlight) -> Response:
    started = time.monotonic()
    a = await _admit(request, state, model_cls, prefix)
    observation = GatewayObservation(state.tracing, state.metrics, request.headers, a.group.name,
                                     a.admission.principal.tenant if a.admission is not None else None,
                                     a.request_id, started)
    settlement: Settlement[[int | None, int, int]] = Settlement(
        ProxiedRequestEnd(state.gateway, a.admission, a.ctx.billed_prompt_tokens, observation))
    try:
        return await _forward(request, state, model_cls, path, a, observation, settlement, waiting)
    except ClientDisconnected:
        await _settle_unanswered(state, a.group, settlement, 499)
        return Response(status_code=499)
    except BaseException as e:
        await _settle_unanswered(state, a.group, settlement, _failure_status(e))
        raise


def _failure_status(e: BaseException) -> int:
    """The status a request that failed before its answer settles with."""
    if isinstance(e, asyncio.CancelledError):
        return 499
    return e.status if isinstance(e, APIError) else 500


async def _settle_unanswered(state: GatewayState, group: ModelGroup, settlement: Settlement[[int | None, int, int]],
                             status: int) -> None:
    """Count and settle a request no answer settled (no usage reported: nothing generated)."""
    if not settlement.settled:
        state.metrics.requests.labels(group.name, str(status)).inc()
        await settlement.settle(status, None, 0, 0)


async def _forward(request: Request, state: GatewayState, model_cls: RequestModel, path: str, a: _Admitted,
                   observation: GatewayObservation, settlement: Settlement[[int | None, int, int]],
                   waiting: InFlight) -> Response:
    """Dispatch to a replica and answer: a 200 stream relayed as it comes (the relay settles when it
    ends), anything else whole (_answer settles)."""
    dispatcher = state.dispatcher
    assert dispatcher is not None  # set by the lifespan before any request
    responses = model_cls is ResponsesRequest or model_cls is MessagesRequest  # their streams always carry usage
    priority = state.gateway.tier_priority(a.admission) if a.admission is not None and state.gateway is not None \
        else None
    headers = _upstream_headers(request, a.request_id, state.config.router.upstream_api_key)
    observation.inject(headers)
    d = await cancel_on_disconnect(request, waiting.guard(dispatcher.dispatch(
        a.group, path, _upstream_body(a.body, a.req, priority, responses, a.cache_salt), headers, a.ctx,
        bool(a.req.stream))))
    extra = a.admission.response_headers if a.admission is not None else {}
    observation.replica(d.replica.url)
    if state.config.router.expose_upstream:
        extra["X-FerryLM-Upstream"] = d.replica.url
    if a.req.stream and d.response.status_code == 200:
        wants_usage = responses or bool(a.req.stream_options and a.req.stream_options.include_usage)
        relay = StreamRelay(d, wants_usage, settlement.settle, state.metrics, dispatcher.record_failure,
                            state.drain.discard, observation, anthropic=model_cls is MessagesRequest)
        state.drain.add(relay)
        return SSEResponse(relay, headers=SSE_HEADERS | extra)
    return await _answer(state, d, settlement.settle, extra)


async def _answer(state: GatewayState, d, settle, extra: dict[str, str]) -> Response:
    """A whole (non-streaming, or error) upstream response, passed through with its status and
    body bytes as they came (a replica's 4xx is the client's answer, OpenAI error body and all)."""
    content, status = d.response.content, d.response.status_code
    usage: dict = {}
    for name in PASSED_HEADERS:
        if name in d.response.headers:
            extra[name] = d.response.headers[name]
    try:
        body = d.response.json() if status == 200 else None
        usage = usage_counts(body.get("usage") or {}) if isinstance(body, dict) else {}
    except ValueError:
        pass
    finally:
        try:
            await d.aclose()
        finally:
            state.metrics.requests.labels(d.group.name, str(status)).inc()
            await settle(status, usage.get("prompt_tokens"), usage.get("completion_tokens", 0),
                         usage.get("cached_tokens", 0))
    return Response(content, status_code=status, media_type="application/json", headers=extra)


async def chat_completions(request: Request) -> Response:
    return await _proxy(request, ChatCompletionRequest, "/v1/chat/completions", "chatcmpl")


async def completions(request: Request) -> Response:
    return await _proxy(request, CompletionRequest, "/v1/completions", "cmpl")


async def create_response(request: Request) -> Response:
    """POST /v1/responses (stateless), proxied like chat: the replica answers in the Responses shape."""
    return await _proxy(request, ResponsesRequest, "/v1/responses", "resp")


async def create_embeddings(request: Request) -> Response:
    """POST /v1/embeddings, proxied to a replica of the model's group (`--runner pooling` there): counted,
    limited and billed as the prompt-only request it is."""
    return await _proxy(request, EmbeddingRequest, "/v1/embeddings", "embd")


async def create_message(request: Request) -> Response:
    """POST /v1/messages (Anthropic's Messages API), proxied like chat: the replica answers in its shape."""
    return await _proxy(request, MessagesRequest, "/v1/messages", "msg")


async def _utility(request: Request, model_cls: type[TokenizeRequest] | type[DetokenizeRequest],
                   path: str) -> Response:
    """/tokenize and /detokenize: authenticated as the /v1 routes, answered by a replica of the
    model's group (the replica's own tokenizer and context length). Nothing is generated, so no
    token limits, quota or load admission apply; a request still counts against requests/min."""
    state = _state(request)
    state.drain.check_admitting()
    dispatcher = state.dispatcher
    assert dispatcher is not None
    caller = await _identify(request, state)
    body = await read_request_body(request, state.config.max_body_bytes)
    group = _group(state, parse_model(model_cls, body).model)
    if caller is not None:
        check_model(caller[0], group.name)  # the tenant's model allowlist, as on generation routes
    request_id = request.state.request_id or new_request_id("tok")
    headers = _upstream_headers(request, request_id, state.config.router.upstream_api_key)
    d = await dispatcher.dispatch(group, path, body, headers, RouteContext(0, 0), stream=False)
    try:
        return Response(d.response.content, status_code=d.response.status_code, media_type="application/json")
    finally:
        await d.aclose()


async def tokenize(request: Request) -> Response:
    return await _utility(request, TokenizeRequest, "/tokenize")


async def detokenize(request: Request) -> Response:
    return await _utility(request, DetokenizeRequest, "/detokenize")


def _model_cards(state: GatewayState) -> dict[str, ModelCard]:
    """Groups and aliases, then the LoRA adapters the replicas hold (parent: their group)."""
    registry = state.registry
    cards = {name: ModelCard(id=name, root=group, max_model_len=registry.groups[group].upstream_max_model_len())
             for name, group in registry.model_names()}
    for group in registry.groups.values():
        for adapter in group.adapters():
            cards.setdefault(adapter, ModelCard(id=adapter, root=adapter, parent=group.name,
                                                max_model_len=group.upstream_max_model_len()))
    return cards


async def list_models(request: Request) -> ModelList:
    state = _state(request)
    if state.gateway is not None:
        await state.gateway.authenticate(request.headers)
    return ModelList(data=list(_model_cards(state).values()))


async def retrieve_model(request: Request, model_id: str) -> ModelCard:
    """GET /v1/models/{id}: a group or alias the gateway routes, 404 model_not_found otherwise."""
    state = _state(request)
    if state.gateway is not None:
        await state.gateway.authenticate(request.headers)
    card = _model_cards(state).get(model_id)
    if card is None:
        raise model_not_found(model_id)
    return card


async def version() -> VersionResponse:
    """GET /version: this gateway's package version (as `ferrylm serve` answers it)."""
    return VersionResponse(version=package_version())


async def health(request: Request) -> JSONResponse:
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> JSONResponse:
    """Ready while not draining and at least one replica of some group can take a request."""
    state = _state(request)
    if state.drain.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    if not state.tokenizers_loaded:
        return JSONResponse({"status": "loading tokenizers"}, status_code=503)
    ok = state.registry.any_available()
    return JSONResponse({"status": "ok" if ok else "no healthy upstream"}, status_code=200 if ok else 503)


async def ops_auth(request: Request) -> None:
    """/metrics' rule, also for /dashboard/data (both name the internal replica URLs)."""
    state = _state(request)
    if state.config.metrics_require_auth:
        await require_credential(request.headers, None, state.gateway)


async def metrics(request: Request) -> Response:
    """Prometheus text. Its `replica` labels name the internal replica URLs, so
    --metrics-require-auth asks for a credential here (open by default, for scrapers)."""
    state = _state(request)
    await ops_auth(request)
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def build_gateway_app(config: GatewayServerConfig, span_exporter: Any = None) -> FastAPI:
    """`span_exporter` (an OpenTelemetry SpanExporter) turns tracing on without an OTLP endpoint (tests)."""
    state = GatewayState(config, span_exporter)
    app = FastAPI(title="FerryLM gateway", version=package_version(), lifespan=state.lifespan)
    app.state.ferry = state
    app.add_middleware(RequestIdMiddleware)
    install_error_handlers(app)
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/responses", create_response, methods=["POST"])
    app.add_api_route("/v1/messages", create_message, methods=["POST"])
    app.add_api_route("/v1/embeddings", create_embeddings, methods=["POST"])
    app.add_api_route("/v1/models", list_models, methods=["GET"], response_model=ModelList)
    app.add_api_route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"], response_model=ModelCard)
    app.add_api_route("/v1/kv/{rest:path}", kv_refused, methods=["POST"], include_in_schema=False)
    app.add_api_route("/tokenize", tokenize, methods=["POST"])
    app.add_api_route("/detokenize", detokenize, methods=["POST"])
    app.add_api_route("/version", version, methods=["GET"], response_model=VersionResponse)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/ready", ready, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.include_router(dashboard_router(lambda request: _state(request).dashboard, ops_auth))
    return app
