"""The credential of an internal route (KV transfer between replicas, runtime LoRA loading): one
secret of its own, distinct from every API and tenant key. No credential: 401; a credential /v1
would refuse too (wrong, revoked): 401; one it accepts (an API or tenant key): 403."""

from __future__ import annotations

import secrets

from fastapi import Request

from ferrylm.http.errors import APIError
from ferrylm.server.auth import require_api_key
from ferrylm.server.state import ServerState


async def require_secret(request: Request, state: ServerState, expected: str | None, what: str) -> None:
    """Pass only `expected` as the Bearer token (compared in constant time); `what` names the API."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if expected is not None and scheme.lower() == "bearer" and \
            secrets.compare_digest(token.strip().encode(), expected.encode()):
        return
    if not token.strip():
        raise APIError(401, f"{what} needs its own credential (Authorization: Bearer).",
                       code="invalid_api_key", type_="invalid_request_error")
    await require_api_key(request)
    if state.gateway is not None:
        await state.gateway.authenticate(request.headers)
    raise APIError(403, f"{what} is an internal API; API and tenant keys cannot use it.",
                   code="permission_denied", type_="invalid_request_error")
