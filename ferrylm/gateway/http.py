"""The one FastAPI-specific piece: GatewayError → an OpenAI-style JSONResponse with its headers."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from ferrylm.gateway.errors import GatewayError


def error_response(err: GatewayError) -> JSONResponse:
    """`{"error": {"message", "type", "param", "code"}}` with Retry-After / x-ratelimit-* headers."""
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)
