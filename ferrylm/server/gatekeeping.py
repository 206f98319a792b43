"""The seam between the HTTP handlers and the gateway: admit before any engine work, finish
(settle limits, charge quotas, audit) once the response ends however it ends (request_end.py)."""

from __future__ import annotations

import dataclasses
import time

from fastapi import Request

from ferrylm.engine.client import EngineClient
from ferrylm.gateway.auth import check_model
from ferrylm.gateway.cache_salt import effective_cache_salt
from ferrylm.gateway.policy import Admission
from ferrylm.gateway.reservation import reserved_tokens
from ferrylm.outputs import Usage
from ferrylm.sampling_params import SamplingParams
from ferrylm.server.fanout import Fanout
from ferrylm.server.state import ServerState


async def authenticate(request: Request, state: ServerState) -> None:
    """401 before anything else (body parsing included), then one request off the caller's
    requests/min buckets (429 before any expensive work, so requests that later fail validation
    count too). The principal and that charge wait in request.state for `admit`."""
    if state.gateway is None:
        return
    client = request.client.host if request.client else None
    request.state.principal, request.state.request_charge = await state.gateway.identify(
        request.headers, client, getattr(request.state, "request_id", None))


async def admit(request: Request, state: ServerState, engine: EngineClient, request_id: str, model: str,
                prompts: list[list[int]], params: SamplingParams, max_model_len: int) -> Admission | None:
    """Auth, rate limits, quotas and load shedding; raises APIError (401/403/429/503) at once."""
    if state.gateway is None:
        return None
    reserved = reserved_tokens([len(p) for p in prompts], params.n, params.max_tokens, max_model_len)
    client = request.client.host if request.client else None
    return await state.gateway.admit(
        request.headers, client, model, reserved.prompt_tokens,
        reserved.output_tokens, engine.stats(), request_id=request_id,
        engine_healthy=engine.is_running, principal=getattr(request.state, "principal", None),
        num_sequences=len(prompts) * params.n, request_charge=getattr(request.state, "request_charge", None))


def check_model_allowed(request: Request, model: str) -> None:
    """403 unless the authenticated tenant may use `model` (routes that name a model but generate
    nothing: /tokenize, /detokenize)."""
    principal = getattr(request.state, "principal", None)
    if principal is not None:
        check_model(principal, model)


def salted(state: ServerState, admission: Admission | None, params: SamplingParams) -> SamplingParams:
    """`params` with the cache salt of the caller's tenant (gateway/cache_salt.py)."""
    if admission is None or state.gateway is None:
        return params
    salt = effective_cache_salt(admission.principal, params.cache_salt, state.gateway.config.shared_prefix_cache)
    return params if salt == params.cache_salt else dataclasses.replace(params, cache_salt=salt)


def priority(state: ServerState, admission: Admission | None, requested: int | None) -> int:
    """With auth on, the tenant's tier decides the priority (clients cannot jump the queue)."""
    tier = state.gateway.tier_priority(admission) if admission is not None and state.gateway is not None else None
    return tier if tier is not None else requested or 0


def usage(fanout: Fanout) -> Usage:
    """What is billed for what the fanout has produced so far: the response's own usage
    (outputs.Usage.of), so both front doors charge alike."""
    return Usage.of([len(p) for p in fanout.prompts], fanout.num_completion_tokens, fanout.num_cached_tokens)


async def finish(state: ServerState, admission: Admission | None, status: int, fanout: Fanout | None,
                 started: float) -> None:
    if admission is None or state.gateway is None:
        return
    billed = usage(fanout) if fanout is not None else Usage(0, 0)  # refused before any engine work
    await state.gateway.finish(admission, status, billed.prompt_tokens, billed.completion_tokens,
                               time.monotonic() - started, cached_tokens=billed.cached_tokens)

