"""API-key check for /v1 routes (`--api-key`): a Bearer token (or Anthropic's `x-api-key` header)
compared in constant time."""

from __future__ import annotations

import secrets

from fastapi import Request

from ferrylm.http.errors import APIError, anthropic_key_as_bearer


async def require_api_key(request: Request) -> None:
    """FastAPI dependency: 401 unless `Authorization: Bearer <key>` matches the configured key."""
    expected = request.app.state.ferry.config.api_key
    if expected is None:
        return
    authorization = request.headers.get("authorization") or anthropic_key_as_bearer(request.headers)
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), expected.encode()):
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key", type_="invalid_request_error")
