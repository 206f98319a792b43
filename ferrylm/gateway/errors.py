"""Gateway refusals as exceptions carrying an OpenAI-style body and the headers to send with it."""

from __future__ import annotations

import math
from collections.abc import Mapping


class GatewayError(Exception):
    """A request the gateway will not pass to the engine: status, OpenAI error fields, headers."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, headers: Mapping[str, str] | None = None, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.headers: dict[str, str] = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.status}, {self.message!r}, code={self.code!r})"


class AuthError(GatewayError):
    """401: no credentials, or credentials that do not check out. The message never says which
    part failed beyond what helps an honest client (expired, revoked)."""

    def __init__(self, message: str = "Incorrect API key provided.", code: str = "invalid_api_key"):
        super().__init__(401, message, "invalid_request_error", code, {"WWW-Authenticate": "Bearer"})


class PermissionDenied(GatewayError):
    """403: the caller is known but may not use this model."""

    def __init__(self, message: str, code: str = "model_not_allowed"):
        super().__init__(403, message, "permission_error", code)


def retry_headers(retry_after_s: float | None) -> dict[str, str]:
    """Retry-After in whole seconds (HTTP) and retry-after-ms (read by the openai SDKs)."""
    if retry_after_s is None:
        return {}
    seconds = max(retry_after_s, 0.0)
    return {"Retry-After": str(max(1, math.ceil(seconds))), "retry-after-ms": str(max(1, math.ceil(seconds * 1000)))}


def too_many_requests(message: str, code: str, type_: str, retry_after_s: float | None,
                      headers: Mapping[str, str] | None = None) -> GatewayError:
    """A 429 with Retry-After (when waiting helps) plus any rate-limit headers."""
    return GatewayError(429, message, type_, code, {**(headers or {}), **retry_headers(retry_after_s)})
