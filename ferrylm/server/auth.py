"""API-key check for /v1 routes (`--api-key`): a Bearer token (or Anthropic's `x-api-key` header)
compared in constant time."""

from __future__ import annotations

import secrets
from collections.abc import Mapping

from fastapi import Request

from ferrylm.http.errors import APIError, anthropic_key_as_bearer


async def require_api_key(request: Request) -> None:
    """FastAPI dependency: 401 unless `Authorization: Bearer <key>` matches the configured key."""
    check_api_key(request.headers, request.app.state.ferry.config.api_key)


def check_api_key(headers: Mapping[str, str], expected: str | None) -> None:
    """APIError 401 unless the headers carry `expected` (None: no key configured, anyone passes)."""
    if expected is None:
        return
    authorization = headers.get("authorization") or anthropic_key_as_bearer(headers)
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), expected.encode()):
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key", type_="invalid_request_error")
