"""The gateway's read of a client body: the server's size-capped JSON read, then a check that the
body can be sent on. The gateway re-encodes the body for the replica (httpx: strict JSON, UTF-8),
so JSON that decodes but cannot be encoded again (NaN or Infinity, which are not JSON; a lone
surrogate such as "\\ud800", which has no UTF-8 form; nesting deeper than the codec recurses)
gets a 400 here instead of a 500 while tokenizing or proxying. http/body.py refuses the last
two itself with a more precise message; this check is what the proxy path relies on."""

from __future__ import annotations

import json

from starlette.requests import Request

from ferrylm.http.body import read_json_body
from ferrylm.http.errors import APIError, invalid


def _too_deep() -> APIError:
    return invalid("The JSON body is nested too deeply.", code="invalid_json")


async def read_request_body(request: Request, limit: int) -> dict:
    """The body as a JSON object that can be forwarded unchanged, or APIError 400/413."""
    try:
        body = await read_json_body(request, limit)
    except RecursionError:
        raise _too_deep() from None
    check_forwardable(body)
    return body


def check_forwardable(body: dict) -> None:
    """400 unless `body` encodes as the replica will receive it (strict JSON in UTF-8)."""
    try:
        json.dumps(body, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise invalid(f"The request contains a lone UTF-16 surrogate ({e.object[e.start:e.end]!r}), which is "
                      "not valid Unicode text.", code="invalid_unicode") from None
    except RecursionError:
        raise _too_deep() from None
    except ValueError:
        raise invalid("The request contains NaN or Infinity, which JSON does not allow.", code="invalid_json") from None
