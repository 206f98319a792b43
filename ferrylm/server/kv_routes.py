"""KV-block transfer between replicas (disaggregated prefill/decode, --kv-role): a prefill replica
exports the K/V of a prompt's cached full blocks, a decode replica imports them into its prefix
cache, so a request for that prompt there starts from a prefix hit. The body is kv_transfer's wire
format (safetensors).

Not a tenant API: these routes answer only the replica-to-replica credential (--kv-transfer-key,
distinct from every API and tenant key; the gateway's disaggregated policy sends it), as vLLM's KV
connectors use an internal channel. No credential: 401; any other (a tenant's key): 403; a replica
with a --kv-role that does not serve the route: 404 (without any, no credential opens them)."""

from __future__ import annotations

from fastapi import Request, Response

from ferrylm.http.body import read_json_body, read_raw_body
from ferrylm.http.errors import APIError, invalid
from ferrylm.kv_transfer import KVLayoutMismatch
from ferrylm.sampling_params import SamplingParamsError, check_cache_salt
from ferrylm.server.internal_auth import KV_TRANSFER, require_secret
from ferrylm.server.state import ServerState


async def _state(request: Request, roles: tuple[str, ...], what: str) -> ServerState:
    """The server state for the transfer credential (401/403 before anything is said about the role)."""
    state: ServerState = request.app.state.ferry
    await require_secret(request, state, KV_TRANSFER)
    if state.config.kv_role not in roles:
        raise APIError(404, f"KV {what} is off on this replica: start it with --kv-role {' or '.join(roles)}.",
                       code="not_found", type_="invalid_request_error")
    return state


async def kv_export(request: Request) -> Response:
    """{"prompt_token_ids": [...], "cache_salt": ...} → the K/V of that prompt's leading full blocks
    cached here under that salt (the one its request ran with)."""
    state = await _state(request, ("prefill", "both"), "export")
    engine = state.admit()
    body = await read_json_body(request, state.config.max_body_bytes)
    ids, salt = body.get("prompt_token_ids"), body.get("cache_salt")
    vocab = engine.model_info.vocab_size
    if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < vocab for t in ids):
        raise invalid(f"'prompt_token_ids' must be a list of token ids (0..{vocab - 1}).", "prompt_token_ids")
    try:
        check_cache_salt(salt)
    except SamplingParamsError as e:
        raise invalid(f"Invalid 'cache_salt': {e}.", "cache_salt") from None
    return Response(content=await engine.export_prefix_kv(ids, salt), media_type="application/octet-stream")


async def kv_import(request: Request) -> dict:
    """A kv_transfer body → {"imported_blocks": n}: blocks not already cached here are written."""
    state = await _state(request, ("decode", "both"), "import")
    engine = state.admit()
    body = await read_raw_body(request, state.config.max_kv_transfer_bytes)
    try:
        return {"imported_blocks": await engine.import_prefix_kv(body)}
    except KVLayoutMismatch as e:
        raise APIError(409, str(e), code="kv_layout_mismatch", type_="invalid_request_error") from None
    except ValueError as e:
        raise invalid(str(e), "body") from None
