"""The gateway's refusals, as the one OpenAI error type (http.errors.APIError) with the headers
that go with them: 401 and 403 for credentials, 429 with Retry-After for limits."""

from __future__ import annotations

import math
from collections.abc import Mapping

from ferrylm.http.errors import APIError


class AuthError(APIError):
    """401: no credentials, or credentials that do not check out. The message never says which
    part failed beyond what helps an honest client (expired, revoked)."""

    def __init__(self, message: str = "Incorrect API key provided.", code: str = "invalid_api_key"):
        super().__init__(401, message, code=code, type_="invalid_request_error")


class PermissionDenied(APIError):
    """403: the caller is known but may not use this model."""

    def __init__(self, message: str, code: str = "model_not_allowed"):
        super().__init__(403, message, code=code, type_="permission_error")


def retry_headers(retry_after_s: float | None) -> dict[str, str]:
    """Retry-After in whole seconds (HTTP) and retry-after-ms (read by the openai SDKs)."""
    if retry_after_s is None:
        return {}
    seconds = max(retry_after_s, 0.0)
    return {"Retry-After": str(max(1, math.ceil(seconds))), "retry-after-ms": str(max(1, math.ceil(seconds * 1000)))}


def too_many_requests(message: str, code: str, type_: str, retry_after_s: float | None,
                      headers: Mapping[str, str] | None = None) -> APIError:
    """A 429 with Retry-After (when waiting helps) plus any rate-limit headers."""
    return APIError(429, message, code=code, type_=type_, headers={**(headers or {}), **retry_headers(retry_after_s)})
