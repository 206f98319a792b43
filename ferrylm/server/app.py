"""The FastAPI app: OpenAI routes (/v1/chat/completions, /v1/completions, /v1/responses,
/v1/models[/{id}]), vLLM's
/tokenize, /detokenize and /version, health,
readiness and metrics, wired to one ServerState. Handlers stay thin: inputs.py validates,
fanout.py runs the engine requests, serving.py shapes the answer."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel

from ferrylm.engine.async_engine import AsyncEngine
from ferrylm.engine.client import EngineClient, EngineDeadError
from ferrylm.engine.engine import Engine
from ferrylm.engine.scheduler import RequestRejected
from ferrylm.gateway.ops_auth import require_credential
from ferrylm.http import messages_protocol
from ferrylm.http.body import read_json_body
from ferrylm.http.chat_dialect import in_dialect_terms
from ferrylm.http.disconnect import SSE_HEADERS, ClientDisconnected, SSEResponse, cancel_on_disconnect
from ferrylm.http.embeddings_protocol import EmbeddingRequest, as_completion_request
from ferrylm.http.error_handlers import install_error_handlers
from ferrylm.http.errors import APIError, engine_dead, invalid, parse_model
from ferrylm.http.messages_protocol import CountTokensRequest, MessagesRequest
from ferrylm.http.middleware import RequestIdMiddleware, new_request_id
from ferrylm.http.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    SamplingRequest,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from ferrylm.http.responses_protocol import RESPONSES, ResponsesRequest, as_chat_request
from ferrylm.http.safe_json import SafeJSONResponse
from ferrylm.http.settlement import SettledStream, Settlement
from ferrylm.observability.dashboard.routes import dashboard_router
from ferrylm.observability.metrics import SequenceTimer
from ferrylm.outputs import RequestOutput
from ferrylm.sampling_params import SamplingParams, SamplingParamsError
from ferrylm.server import (
    gatekeeping,
    inputs,
    kv_routes,
    lora_routes,
    messages,
    prompts,
    responses,
    serving,
    structured,
    tokenize,
)
from ferrylm.server.auth import require_api_key
from ferrylm.server.config import ServerConfig
from ferrylm.server.embeddings import embeddings_shaper
from ferrylm.server.fanout import Fanout
from ferrylm.server.health import liveness
from ferrylm.server.internal_auth import KV_TRANSFER, LORA_ADMIN
from ferrylm.server.internal_gate import InternalRouteGate
from ferrylm.server.prompts import check_num_sequences
from ferrylm.server.reasoning import ReasoningParser, answer_only, closed_in_prompt, for_prompt, parser_for
from ferrylm.server.request_end import RequestEnd
from ferrylm.server.request_trace import RequestTrace
from ferrylm.server.serving import ResponseContext
from ferrylm.server.state import ServerState
from ferrylm.server.tools import ToolPlan
from ferrylm.version import package_version

log = logging.getLogger("ferrylm.server")
B = TypeVar("B", bound=BaseModel)


def _state(request: Request) -> ServerState:
    return request.app.state.ferry


def _request_id(request: Request, prefix: str) -> str:
    """The client's X-Request-Id if sent, else a fresh one; it is the response id and the header."""
    rid = request.state.request_id or new_request_id(prefix)
    request.state.request_id = rid
    return rid


async def _start(state: ServerState, engine: EngineClient, ctx: ResponseContext, prompts: list[list[int]],
                 params: SamplingParams, req: SamplingRequest | EmbeddingRequest, priority: int,
                 tenant: str | None = None) -> Fanout:
    log.info("request", extra={"request_id": ctx.request_id, "model": ctx.model, "n": params.n,
                               "prompt_tokens": [len(p) for p in prompts], "max_tokens": params.max_tokens,
                               "stream": bool(req.stream), "user": req.user})
    fanout = Fanout(engine, ctx.request_id, prompts, params, priority,
                    observer_factory=lambda: SequenceTimer(state.metrics, ctx.start, tenant), registry=state.drain,
                    max_backlog=state.config.max_stream_backlog if req.stream else None,
                    lora_name=state.adapter_of(ctx.model))
    try:
        await fanout.start()
    except (RequestRejected, SamplingParamsError) as e:
        raise invalid(str(e), getattr(e, "param", None)) from None
    except EngineDeadError:
        raise engine_dead() from None
    return fanout


async def _serve(request: Request, state: ServerState, engine: EngineClient, ctx: ResponseContext,
                 prompts: list[list[int]], params: SamplingParams, req: SamplingRequest | EmbeddingRequest,
                 streamer: Callable,
                 shaper: Callable) -> Response:
    """Gateway admission → engine → SSE or JSON; one Settlement settles the gateway and the trace
    once the response ends, however it ends."""
    started = time.monotonic()
    admission = await gatekeeping.admit(request, state, engine, ctx.request_id, ctx.model, prompts, params,
                                        engine.model_info.max_model_len)
    headers = admission.response_headers if admission is not None else {}
    tenant = admission.principal.tenant if admission is not None else None
    params = gatekeeping.salted(state, admission, params)
    trace = RequestTrace(state.tracing, request.headers, ctx.request_id, ctx.model, ctx.start, params, tenant) \
        if state.tracing is not None else None
    end = RequestEnd(state, admission, trace, started)
    settlement: Settlement[[]] = Settlement(end)
    try:
        end.fanout = fanout = await _start(state, engine, ctx, prompts, params, req,
                                           gatekeeping.priority(state, admission, req.priority), tenant)
    except APIError as e:
        await settlement.settle(e.status)
        raise
    if req.stream:
        return SSEResponse(SettledStream(streamer(ctx, fanout), settlement), headers=SSE_HEADERS | headers)
    finals = await _collect(request, ctx, fanout, settlement)
    if finals is None:
        return Response(status_code=499)
    return SafeJSONResponse(shaper(ctx, fanout, finals), headers=headers)


async def _collect(request: Request, ctx: ResponseContext, fanout: Fanout, settlement: Settlement[[]]
                   ) -> list[RequestOutput] | None:
    """A non-streaming request run to its end (None: the client left first), settled however it ended."""
    status = 500
    try:
        finals = await cancel_on_disconnect(request, serving.collect(fanout))
        status = 200
        return finals
    except ClientDisconnected:
        status = 499
        log.info("client disconnected; request aborted", extra={"request_id": ctx.request_id})
        return None
    except EngineDeadError:
        status = 503
        raise engine_dead() from None
    finally:
        await settlement.settle(status)


async def _admitted(request: Request, model_cls: type[B], runner: str | None) -> tuple[ServerState, AsyncEngine, B]:
    """Every generating route's preamble, in the order a client sees its errors: 401/429 before
    anything else, 400 for a route this --runner does not serve, 503 unless the engine takes a
    request now, then the body read and parsed (413/400)."""
    state = _state(request)
    await gatekeeping.authenticate(request, state)
    if runner is not None:
        _require_runner(state, runner)
    engine = state.admit()
    return state, engine, parse_model(model_cls, await read_json_body(request, state.config.max_body_bytes))


async def _chat_inputs(request: Request, engine: EngineClient, req: ChatCompletionRequest, what: str
                       ) -> tuple[SamplingParams, ToolPlan | None, list[int], ReasoningParser | None]:
    """A chat request's SamplingParams, tool plan, prompt ids and reasoning parser, each checked (400s):
    the fields, the context window (`what` names the field the prompt came from) and the output
    constraint, which under a reasoning parser applies to the answer only (from the first token when
    the prompt closed the thinking)."""
    core = engine.model_info
    params, tool_plan = inputs.chat_params(req, core.vocab_size)
    config = request.app.state.ferry.config
    prompt = await prompts.chat_prompt_ids(core.tokenizer, req, core.max_model_len)
    parser = parser_for(config.reasoning_parser)
    if parser is not None and closed_in_prompt(parser, core.tokenizer, prompt):
        parser = for_prompt(parser, core.tokenizer, prompt)
    elif params.structured_outputs is not None and parser is not None and not config.constrain_reasoning:
        params.structured_outputs = answer_only(params.structured_outputs, parser, core.tokenizer)
    inputs.check_fits(prompt, params.max_tokens, core.max_model_len, what)
    if params.structured_outputs is not None:
        await structured.check_compiles(engine, params.structured_outputs, request)
    return params, tool_plan, prompt, parser


async def chat_completions(request: Request) -> Response:
    state, engine, req = await _admitted(request, ChatCompletionRequest, "generate")
    ctx_id = _request_id(request, "chatcmpl")
    model = state.resolve_model(req.model)
    core = engine.model_info
    check_num_sequences(1, req.n or 1, state.config.max_sequences_per_request)
    params, tool_plan, prompt, reasoning = await _chat_inputs(request, engine, req, "messages")
    ctx = ResponseContext(ctx_id, model, core.tokenizer, params.logprobs,
                          bool(req.stream_options and req.stream_options.include_usage), tools=tool_plan,
                          timings=bool(req.timings), reasoning=reasoning)
    return await _serve(request, state, engine, ctx, [prompt], params, req, serving.stream_chat,
                        serving.chat_response)


async def completions(request: Request) -> Response:
    state, engine, req = await _admitted(request, CompletionRequest, "generate")
    ctx_id = _request_id(request, "cmpl")
    model = state.resolve_model(req.model)
    core = engine.model_info
    check_num_sequences(prompts.completion_prompt_count(req), req.n or 1, state.config.max_sequences_per_request)
    params = inputs.completion_params(req, core.vocab_size)
    prompt_ids = await prompts.completion_prompt_ids(core.tokenizer, req, core.vocab_size, core.max_model_len)
    for prompt in prompt_ids:
        inputs.check_fits(prompt, params.max_tokens, core.max_model_len, "prompt")
    if params.structured_outputs is not None:
        await structured.check_compiles(engine, params.structured_outputs, request)
    echo = [core.tokenizer.decode(p, skip_special_tokens=False) if not isinstance(req.prompt, str) else req.prompt
            for p in prompt_ids] if req.echo else None
    ctx = ResponseContext(ctx_id, model, core.tokenizer, params.logprobs,
                          bool(req.stream_options and req.stream_options.include_usage), echo,
                          prompt_logprobs=req.prompt_logprobs, timings=bool(req.timings))
    return await _serve(request, state, engine, ctx, prompt_ids, params, req, serving.stream_completion,
                        serving.completion_response)


async def create_response(request: Request) -> Response:
    """POST /v1/responses: run as a one-choice chat request, answered in the Responses shape."""
    state, engine, body = await _admitted(request, ResponsesRequest, "generate")
    req = as_chat_request(body)
    ctx_id = _request_id(request, "resp")
    model = state.resolve_model(req.model)
    core = engine.model_info
    try:
        params, tool_plan, prompt, reasoning = await _chat_inputs(request, engine, req, "input")
    except APIError as e:  # name the Responses field, not the chat one it became
        raise in_dialect_terms(e, RESPONSES) from None
    ctx = ResponseContext(ctx_id, model, core.tokenizer, tools=tool_plan, reasoning=reasoning)
    echo = responses.echo_fields(body)
    return await _serve(request, state, engine, ctx, [prompt], params, req, responses.responses_streamer(echo),
                        responses.responses_shaper(echo))


async def create_message(request: Request) -> Response:
    """POST /v1/messages (Anthropic's Messages API): run as a one-choice chat request."""
    state, engine, body = await _admitted(request, MessagesRequest, "generate")
    req = messages_protocol.as_chat_request(body)
    request.state.request_id = request.state.request_id or messages.message_id()
    ctx_id = _request_id(request, "msg")
    model = state.resolve_model(req.model)
    core = engine.model_info
    try:
        params, tool_plan, prompt, reasoning = await _chat_inputs(request, engine, req, "messages")
    except APIError as e:
        raise in_dialect_terms(e, messages_protocol.MESSAGES) from None
    ctx = ResponseContext(ctx_id, model, core.tokenizer, tools=tool_plan, reasoning=reasoning)
    return await _serve(request, state, engine, ctx, [prompt], params, req, messages.messages_stream,
                        messages.messages_response)


def _require_runner(state: ServerState, runner: str) -> None:
    """400 for a route the server's --runner does not serve (vLLM answers the same way)."""
    if state.config.runner == runner:
        return
    if runner == "pooling":
        raise invalid("This server generates text; embeddings need a server started with --runner pooling.",
                      code="wrong_runner")
    raise invalid("This server runs --runner pooling: it serves POST /v1/embeddings, not text generation.",
                  code="wrong_runner")


async def create_embeddings(request: Request) -> Response:
    """POST /v1/embeddings (--runner pooling): every input prefilled once and pooled into a vector."""
    state, engine, req = await _admitted(request, EmbeddingRequest, "pooling")
    ctx_id = _request_id(request, "embd")
    model = state.resolve_model(req.model)
    core = engine.model_info
    if req.input == "" or req.input == [] or (isinstance(req.input, list) and any(p in ("", []) for p in req.input)):
        raise invalid("'input' must not be empty (nor hold an empty string or token list).", "input")
    as_completion = as_completion_request(req)
    check_num_sequences(prompts.completion_prompt_count(as_completion), 1, state.config.max_sequences_per_request)
    try:
        prompt_ids = await prompts.completion_prompt_ids(core.tokenizer, as_completion, core.vocab_size,
                                                         core.max_model_len)
        for prompt in prompt_ids:
            inputs.check_fits(prompt, 0, core.max_model_len, "input")
    except APIError as e:
        e.param = "input" if e.param == "prompt" else e.param
        e.message = e.message.replace("'prompt'", "'input'")
        raise
    params = SamplingParams(max_tokens=0, pooling=state.config.pooling_type, normalize=state.config.pooling_normalize,
                            cache_salt=req.cache_salt)
    ctx = ResponseContext(ctx_id, model, core.tokenizer)
    return await _serve(request, state, engine, ctx, prompt_ids, params, req, serving.stream_chat,  # never streams
                        embeddings_shaper(req))


async def count_message_tokens(request: Request) -> JSONResponse:
    """POST /v1/messages/count_tokens: the prompt tokens a Messages request would take (its system,
    messages and tools through the served model's chat template)."""
    state, engine, body = await _admitted(request, CountTokensRequest, None)
    req = messages_protocol.count_tokens_chat_request(body)
    gatekeeping.check_model_allowed(request, state.resolve_model(req.model))
    try:
        inputs.chat_params(req, engine.model_info.vocab_size)
        prompt = await prompts.chat_prompt_ids(engine.model_info.tokenizer, req, engine.model_info.max_model_len)
    except APIError as e:
        raise in_dialect_terms(e, messages_protocol.MESSAGES) from None
    return JSONResponse({"input_tokens": len(prompt)})


async def list_models(request: Request) -> ModelList:
    state = _state(request)
    await gatekeeping.authenticate(request, state)  # 401 as on the other /v1 routes
    adapters = state.engine.lora_adapters() if state.engine is not None and state.config.enable_lora else []
    return ModelList(data=[_model_card(state, name) for name in state.config.served_model_names]
                     + [_model_card(state, a.name) for a in adapters])


def _model_card(state: ServerState, name: str) -> ModelCard:
    """The card of served name `name` (root and context length once the engine is up); a LoRA
    adapter's, as vLLM's, has its directory as root and the base model's served name as parent."""
    info = state.engine.model_info if state.engine is not None else None
    adapter = state.adapter_of(name)
    root = next((a.path for a in state.engine.lora_adapters() if a.name == adapter), None) \
        if adapter is not None and state.engine is not None else info.model if info is not None else None
    return ModelCard(id=name, root=root, parent=state.config.model_name if adapter is not None else None,
                     max_model_len=info.max_model_len if info is not None else None)


async def retrieve_model(request: Request, model_id: str) -> ModelCard:
    """GET /v1/models/{id}: the card of one served name, 404 model_not_found otherwise."""
    state = _state(request)
    await gatekeeping.authenticate(request, state)
    return _model_card(state, state.resolve_model(model_id))


async def version() -> VersionResponse:
    """GET /version, as vLLM answers it: the package's version."""
    return VersionResponse(version=package_version())


async def health(request: Request) -> JSONResponse:
    verdict = liveness(_state(request).engine, _state(request).config.heartbeat_timeout_s)
    return JSONResponse({"status": verdict.reason}, status_code=200 if verdict.ok else 503)


async def ready(request: Request) -> JSONResponse:
    state = _state(request)
    verdict = liveness(state.engine, state.config.heartbeat_timeout_s)
    if state.drain.draining:
        reason = "draining"
    elif state.load_error is not None:
        reason = f"load failed: {state.load_error}"
    elif not state.ready or state.probe is None:
        reason = "loading"
    elif not verdict.ok:
        reason = verdict.reason
    else:
        verdict = await state.probe.check()
        reason = verdict.reason if not verdict.ok else "ok"
    return JSONResponse({"status": reason}, status_code=200 if reason == "ok" else 503)


async def load(request: Request) -> JSONResponse:
    """The engine's stats snapshot as JSON, for a gateway in front of this replica: admission
    control and least-outstanding-token routing read it (503 until the engine is up)."""
    state = _state(request)
    if state.config.metrics_require_auth:  # the gateway polls it with its --upstream-api-key
        await require_credential(request.headers, state.config.api_key, state.gateway)
    engine = state.engine
    if engine is None or not state.ready:
        return JSONResponse({"status": "loading"}, status_code=503)
    report = dataclasses.replace(engine.stats(), healthy=engine.is_running and not state.drain.draining)
    info = engine.model_info
    body = report.to_json() | {  # the report, then what the router learns about the replica itself
        "block_size": info.block_size, "max_model_len": info.max_model_len,
        "models": list(state.config.served_model_names)}
    return JSONResponse(body)


async def metrics(request: Request) -> Response:
    """Prometheus text; open unless --metrics-require-auth (then /v1's credential, 401 without)."""
    state = _state(request)
    await ops_auth(request)
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def ops_auth(request: Request) -> None:
    """/metrics' rule, also for /dashboard/data: open unless --metrics-require-auth."""
    state = _state(request)
    if state.config.metrics_require_auth:
        await require_credential(request.headers, state.config.api_key, state.gateway)


def _hooked_engine(request: Request) -> AsyncEngine:
    """The engine a test hook acts on, loaded or not yet warm (503 before it exists)."""
    engine = _state(request).engine
    if engine is None:
        raise APIError(503, "The model is still loading.", code="model_loading")
    return engine


async def debug_stall(request: Request, seconds: float) -> dict:
    """Test hook (FERRYLM_TEST_HOOKS=1 only): wedge the engine loop for `seconds`."""
    engine = _hooked_engine(request)
    engine.stall_for(seconds)
    return {"stalled_for": seconds}


async def debug_kv(request: Request) -> dict:
    """Test hook (FERRYLM_TEST_HOOKS=1 only): check the engine's invariants between two steps and
    report the KV blocks held, so the fault suite can prove nothing leaked once the server is idle."""
    engine = _hooked_engine(request)
    check = getattr(engine, "check_invariants", None)
    if check is not None:
        await asyncio.to_thread(check)
    stats = engine.stats()
    return {"kv_blocks_used": stats.kv_blocks_used, "num_running": stats.num_running,
            "num_waiting": stats.num_waiting, "num_swapped": stats.num_swapped,
            "invariants": "ok" if check is not None else "unchecked"}


async def debug_runner(request: Request) -> dict:
    """Test hook (FERRYLM_TEST_HOOKS=1 only): whether decode steps run the compiled graphs yet (they
    compile or load in the background after start-up), so a benchmark can wait for the serving path
    it means to measure."""
    engine = _hooked_engine(request)
    executor = getattr(getattr(engine, "engine", None), "executor", None)
    runner = getattr(executor, "runner", executor)  # a tensor-parallel executor wraps rank 0's runner
    return {"decode_compiled": getattr(runner, "compiled", None) is not None}


def _inline_refs(node: Any, defs: dict) -> Any:
    """`node` with every `{"$ref": "#/$defs/X", ...}` replaced by X itself (plus the siblings)."""
    if isinstance(node, list):
        return [_inline_refs(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        rest = {k: v for k, v in node.items() if k != "$ref"}
        return _inline_refs(defs[node["$ref"].rsplit("/", 1)[-1]], defs) | _inline_refs(rest, defs)
    return {k: _inline_refs(v, defs) for k, v in node.items()}


_ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}


_ANTHROPIC_ERROR_SCHEMA = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"], "properties": {
        "type": {"type": "string"}, "message": {"type": "string"}}}}}


def error_responses(*statuses: int, anthropic: bool = False) -> dict:
    """`responses` documenting OpenAI-style error answers with these statuses (Anthropic's shape,
    for the Messages API's routes, with `anthropic`)."""
    content = {"application/json": {"schema": _ANTHROPIC_ERROR_SCHEMA if anthropic else _ERROR_SCHEMA}}
    return {status: {"description": HTTPStatus(status).phrase, "content": content} for status in statuses}


def json_body_openapi(model: type[BaseModel]) -> dict:
    """`openapi_extra` declaring `model` as the JSON request body. The handlers read and validate
    the body themselves (size cap, OpenAI-style 400s), so FastAPI cannot infer it; the schema's
    $defs are inlined because an operation cannot add to components/schemas."""
    schema = model.model_json_schema()
    schema = _inline_refs(schema, schema.pop("$defs", {}))
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def build_app(config: ServerConfig, engine_factory: Callable[[], Engine], span_exporter: Any = None) -> FastAPI:
    """An app serving one model; the engine is built by `engine_factory` in the background at startup.
    `span_exporter` (an OpenTelemetry SpanExporter) turns tracing on without an OTLP endpoint (tests)."""
    state = ServerState(config, engine_factory, span_exporter)
    app = FastAPI(title="FerryLM", version=package_version(), lifespan=state.lifespan)
    app.state.ferry = state
    install_error_handlers(app)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)], responses=error_responses(401))
    generation_errors = error_responses(400, 403, 404, 413, 429, 503)
    v1.add_api_route("/chat/completions", chat_completions, methods=["POST"],
                     responses={200: {"model": ChatCompletionResponse, "content": {"text/event-stream": {}}}}
                     | generation_errors, openapi_extra=json_body_openapi(ChatCompletionRequest))
    v1.add_api_route("/completions", completions, methods=["POST"],
                     responses={200: {"model": CompletionResponse, "content": {"text/event-stream": {}}}}
                     | generation_errors, openapi_extra=json_body_openapi(CompletionRequest))
    v1.add_api_route("/responses", create_response, methods=["POST"],
                     responses={200: {"content": {"text/event-stream": {}}}} | generation_errors,
                     openapi_extra=json_body_openapi(ResponsesRequest))
    v1.add_api_route("/messages", create_message, methods=["POST"],
                     responses={200: {"content": {"text/event-stream": {}}}}
                     | error_responses(400, 401, 403, 404, 413, 429, 503, anthropic=True),
                     openapi_extra=json_body_openapi(MessagesRequest))
    v1.add_api_route("/messages/count_tokens", count_message_tokens, methods=["POST"],
                     responses=error_responses(400, 401, 403, 404, 413, 503, anthropic=True),
                     openapi_extra=json_body_openapi(CountTokensRequest))
    v1.add_api_route("/embeddings", create_embeddings, methods=["POST"], responses=generation_errors,
                     openapi_extra=json_body_openapi(EmbeddingRequest))
    v1.add_api_route("/models", list_models, methods=["GET"], response_model=ModelList)
    v1.add_api_route("/models/{model_id:path}", retrieve_model, methods=["GET"], response_model=ModelCard,
                     responses=error_responses(404))
    app.include_router(v1)
    kv = APIRouter(prefix="/v1/kv", responses=error_responses(401, 403))  # its own credential (kv_routes)
    kv.add_api_route("/export", kv_routes.kv_export, methods=["POST"], responses=error_responses(400, 404, 503))
    kv.add_api_route("/import", kv_routes.kv_import, methods=["POST"],
                     responses=error_responses(400, 404, 409, 413, 503))
    app.include_router(kv)
    lora = APIRouter(prefix="/v1", responses=error_responses(400, 401, 403, 404, 409, 503))  # --lora-admin-key
    lora.add_api_route("/load_lora_adapter", lora_routes.load_lora_adapter, methods=["POST"],
                       response_class=PlainTextResponse)
    lora.add_api_route("/unload_lora_adapter", lora_routes.unload_lora_adapter, methods=["POST"],
                       response_class=PlainTextResponse)
    app.include_router(lora)
    internal = {route.path: KV_TRANSFER for route in kv.routes if isinstance(route, APIRoute)} | \
        {route.path: LORA_ADMIN for route in lora.routes if isinstance(route, APIRoute)}
    app.add_middleware(InternalRouteGate, state=state, routes=internal)  # added first: inside RequestIdMiddleware
    app.add_middleware(RequestIdMiddleware)
    tokens = APIRouter(dependencies=[Depends(require_api_key)], responses=error_responses(400, 401, 404, 503))
    tokens.add_api_route("/tokenize", tokenize.tokenize, methods=["POST"], response_model=TokenizeResponse,
                         openapi_extra=json_body_openapi(TokenizeRequest))
    tokens.add_api_route("/detokenize", tokenize.detokenize, methods=["POST"], response_model=DetokenizeResponse,
                         openapi_extra=json_body_openapi(DetokenizeRequest))
    app.include_router(tokens)
    app.add_api_route("/version", version, methods=["GET"], response_model=VersionResponse)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/ready", ready, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/load", load, methods=["GET"])
    app.include_router(dashboard_router(lambda request: _state(request).dashboard, ops_auth))
    if config.test_hooks:
        app.add_api_route("/debug/stall", debug_stall, methods=["POST"])
        app.add_api_route("/debug/kv", debug_kv, methods=["GET"])
        app.add_api_route("/debug/runner", debug_runner, methods=["GET"])
    return app
