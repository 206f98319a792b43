"""Reading a JSON request body with a size cap, so a huge or broken body gets a clean 4xx."""

from __future__ import annotations

import json
import re

from starlette.requests import Request

from ferrylm.http.errors import APIError, invalid

# An oversize body is read and thrown away up to this many times the limit, so the client sees
# the 413 instead of a connection reset mid-upload; beyond that the connection is cut.
_DRAIN_FACTOR = 16
# Deeper bodies get 400 before any code recurses over them (json.loads itself raises
# RecursionError near 1000 levels; pydantic, logging and our own walks recurse too). serde_json's
# default; an OpenAI request is a handful of levels deep, a JSON schema a few dozen.
MAX_JSON_DEPTH = 128
# A `\uD800`-`\uDFFF` escape in the text: the only way a body that is valid UTF-8 can decode to a
# str holding a surrogate (a valid escaped pair decodes to one character, so any left is lone).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than the limit of {limit} bytes.", code="request_too_large")


async def _discard_rest(request: Request, already: int, limit: int) -> None:
    seen = already
    async for chunk in request.stream():
        seen += len(chunk)
        if seen > limit * _DRAIN_FACTOR:
            return


async def read_raw_body(request: Request, limit: int) -> bytes:
    """The body's bytes; 413 above `limit` (binary bodies: KV-block transfers)."""
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
    return b"".join(parts)


async def read_json_body(request: Request, limit: int) -> dict:
    """The body as a JSON object; 413 above `limit` bytes, 400 for bad UTF-8, bad JSON or a non-object."""
    raw = await read_raw_body(request, limit)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid(f"The request body is not valid UTF-8 ({e.reason} at byte {e.start}).") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise invalid(f"We could not parse the JSON body of your request ({e.msg} at line {e.lineno} "
                      f"column {e.colno}).") from None
    except RecursionError:
        raise _too_deep() from None
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    _check_depth_and_strings(body, text)
    return body


def _too_deep() -> APIError:
    return invalid(f"The JSON body of your request is nested more than {MAX_JSON_DEPTH} levels deep.")


def _lone_surrogate(path: tuple, char: str, in_key: bool) -> APIError:
    """400 naming the field ("messages.0.content"); a bad key is named by its parent (the param must
    itself be encodable)."""
    param = ".".join(str(part) for part in path) or None
    what = (f"A key in '{param}'" if param else "A key") if in_key else f"Invalid '{param}': the string"
    return invalid(f"{what} holds a lone UTF-16 surrogate (\\u{ord(char):04x}), which is not a Unicode "
                   "character; send valid UTF-8 or a complete \\uD8xx\\uDCxx pair.", param)


def _check_depth_and_strings(body: dict, text: str) -> None:
    """400 for nesting deeper than MAX_JSON_DEPTH or a string (value or key) with a lone surrogate,
    which the tokenizer, the logs and the response encoder cannot encode. Walks the decoded body
    (iteratively) only when the raw text could hold either, so ordinary bodies cost two scans."""
    deep = text.count("[") + text.count("{") > MAX_JSON_DEPTH
    surrogates = _SURROGATE_ESCAPE.search(text) is not None
    if not (deep or surrogates):
        return
    stack: list[tuple[dict | list, tuple, int]] = [(body, (), 1)]
    while stack:
        node, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise _too_deep()
        for key, value in node.items() if isinstance(node, dict) else enumerate(node):
            if surrogates and isinstance(key, str) and (bad := _SURROGATE.search(key)):
                raise _lone_surrogate(path, bad.group(), in_key=True)
            if isinstance(value, (dict, list)):
                stack.append((value, (*path, key), depth + 1))
            elif surrogates and isinstance(value, str) and (bad := _SURROGATE.search(value)):
                raise _lone_surrogate((*path, key), bad.group(), in_key=False)
