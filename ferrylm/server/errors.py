"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with OpenAI's status codes."""

from __future__ import annotations

import logging

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("ferrylm.server")

_TYPE_BY_STATUS = {404: "invalid_request_error", 413: "invalid_request_error",
                   500: "server_error", 503: "server_error"}


class APIError(Exception):
    """An error answered to the client; raised anywhere in request handling."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _TYPE_BY_STATUS.get(status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 invalid_request_error, the answer to almost every bad input."""
    return APIError(400, message, param, code)


def from_validation_error(errors: list[dict]) -> APIError:
    """The first pydantic error as a 400 naming the offending field, like OpenAI's "Invalid 'x': ..."."""
    if not errors:
        return invalid("invalid request body")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # Union members add their type name to the location ("stop.list[str].0"); drop those.
    loc = [part for part in loc if "[" not in part and part not in {"str", "int", "float", "bool"}]
    param = ".".join(loc) or None
    if first.get("type") == "missing":
        return invalid(f"Missing required parameter: '{param}'.", param)
    message = f"Invalid '{param}': {first.get('msg', 'invalid value')}." if param else first.get("msg", "invalid")
    return invalid(message, param)


def parse_model(model_cls: type[pydantic.BaseModel], body: object) -> pydantic.BaseModel:
    """Validate a decoded JSON body against a request schema, raising a 400 APIError."""
    try:
        return model_cls.model_validate(body)
    except pydantic.ValidationError as e:
        raise from_validation_error(e.errors(include_url=False)) from None


def install_error_handlers(app: FastAPI) -> None:
    """Every error path, including unknown routes and crashes, answers in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_error(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        else:
            message = str(exc.detail)
        return APIError(exc.status_code, message).response()

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error", exc_info=exc, extra={"request_id": getattr(request.state, "request_id", None)})
        return APIError(500, "The server had an error while processing your request.").response()
