"""Every error path of a FastAPI app, including unknown routes and crashes, answered in OpenAI's shape
(Anthropic's under /v1/messages, where Anthropic's SDK reads its own)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ferrylm.http.errors import APIError, from_validation_error
from ferrylm.http.messages_protocol import anthropic_error_body


def error_response(request: Request, error: APIError) -> JSONResponse:
    """`error` in the shape the route's clients read."""
    if request.url.path.startswith("/v1/messages"):
        return JSONResponse(anthropic_error_body(error), status_code=error.status, headers=error.headers or None)
    return error.response()

log = logging.getLogger("ferrylm.http")


def install_error_handlers(app: FastAPI) -> None:
    """Every error path, including unknown routes and crashes, answers in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(request, from_validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        else:
            message = str(exc.detail)
        return error_response(request, APIError(exc.status_code, message))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error", exc_info=exc, extra={"request_id": getattr(request.state, "request_id", None)})
        return error_response(request, APIError(500, "The server had an error while processing your request."))
