"""The credential of an internal route (KV transfer between replicas, runtime LoRA loading): one
secret of its own, distinct from every API and tenant key. No credential: 401; a credential /v1
would refuse too (wrong, revoked): 401; one it accepts (an API or tenant key): 403."""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import NamedTuple

from fastapi import Request

from ferrylm.http.errors import APIError
from ferrylm.server.auth import check_api_key
from ferrylm.server.state import ServerState


class InternalCredential(NamedTuple):
    """An internal API: the ServerConfig field holding its secret, and its name in refusals."""

    field: str
    what: str

    def secret(self, state: ServerState) -> str | None:
        return getattr(state.config, self.field)


KV_TRANSFER = InternalCredential("kv_transfer_key", "KV transfer (replica to replica)")
LORA_ADMIN = InternalCredential("lora_admin_key", "Loading LoRA adapters")


async def require_secret(request: Request, state: ServerState, credential: InternalCredential) -> None:
    """Pass only the credential's secret as the Bearer token (compared in constant time)."""
    await check_secret(request.headers, state, credential)


async def check_secret(headers: Mapping[str, str], state: ServerState, credential: InternalCredential) -> None:
    """require_secret on bare headers (internal_gate.py checks before FastAPI routes the request)."""
    expected, what = credential.secret(state), credential.what
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if expected is not None and scheme.lower() == "bearer" and \
            secrets.compare_digest(token.strip().encode(), expected.encode()):
        return
    if not token.strip():
        raise APIError(401, f"{what} needs its own credential (Authorization: Bearer).",
                       code="invalid_api_key", type_="invalid_request_error")
    check_api_key(headers, state.config.api_key)
    if state.gateway is not None:
        await state.gateway.authenticate(headers)
    raise APIError(403, f"{what} is an internal API; API and tenant keys cannot use it.",
                   code="permission_denied", type_="invalid_request_error")
