"""Reading a JSON request body with a size cap, so a huge or broken body gets a clean 4xx."""

from __future__ import annotations

import json

from starlette.requests import Request

from ferrylm.server.errors import APIError, invalid

# An oversize body is read and thrown away up to this many times the limit, so the client sees
# the 413 instead of a connection reset mid-upload; beyond that the connection is cut.
_DRAIN_FACTOR = 16


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than the limit of {limit} bytes.", code="request_too_large")


async def _discard_rest(request: Request, already: int, limit: int) -> None:
    seen = already
    async for chunk in request.stream():
        seen += len(chunk)
        if seen > limit * _DRAIN_FACTOR:
            return


async def read_json_body(request: Request, limit: int) -> dict:
    """The body as a JSON object; 413 above `limit` bytes, 400 for bad UTF-8, bad JSON or a non-object."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        await _discard_rest(request, 0, limit)
        raise _too_large(limit)
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            await _discard_rest(request, size, limit)
            raise _too_large(limit)
        parts.append(chunk)
    raw = b"".join(parts)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid(f"The request body is not valid UTF-8 ({e.reason} at byte {e.start}).") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise invalid(f"We could not parse the JSON body of your request ({e.msg} at line {e.lineno} "
                      f"column {e.colno}).") from None
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    return body
