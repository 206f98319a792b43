"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with OpenAI's status codes.

No FastAPI here (the gateway's policy raises these without an app); error_handlers.py installs them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import pydantic
from starlette.responses import JSONResponse

M = TypeVar("M", bound=pydantic.BaseModel)
_TYPE_BY_STATUS = {404: "invalid_request_error", 413: "invalid_request_error",
                   500: "server_error", 503: "server_error"}


class APIError(Exception):
    """The one error answered to a client, by either front end and by the gateway's policy: an
    OpenAI error body, its status, and the headers to send (Retry-After, x-ratelimit-*)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _TYPE_BY_STATUS.get(status, "invalid_request_error")
        self.headers: dict[str, str] = dict(headers or {})
        if status == 401:
            self.headers.setdefault("WWW-Authenticate", "Bearer")
        if status == 503 and not any(k.lower() == "retry-after" for k in self.headers):
            # every 503 is temporary here (draining, loading, no healthy replica): say when to retry,
            # so clients and the gateway back off instead of hammering or giving up
            self.headers["Retry-After"] = "1"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.status}, {self.message!r}, code={self.code!r})"


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 invalid_request_error, the answer to almost every bad input."""
    return APIError(400, message, param, code)


def engine_dead() -> APIError:
    """503: the engine loop stopped under a request (or before it); another replica can serve it."""
    return APIError(503, "The engine stopped; retry on another replica.", code="engine_dead")


def model_not_found(name: str | None) -> APIError:
    """404: a model name no replica or served name answers to, as OpenAI words it."""
    return APIError(404, f"The model `{name}` does not exist.", "model", "model_not_found")


def from_validation_error(errors: Sequence[Any]) -> APIError:
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


def parse_model(model_cls: type[M], body: object) -> M:
    """Validate a decoded JSON body against a request schema, raising a 400 APIError."""
    try:
        return model_cls.model_validate(body)
    except pydantic.ValidationError as e:
        raise from_validation_error(e.errors(include_url=False)) from None


def anthropic_key_as_bearer(headers) -> str | None:
    """`Bearer <key>` from Anthropic's `x-api-key` header (its SDK sends no Authorization), or None."""
    key = headers.get("x-api-key")
    return f"Bearer {key}" if key else None
