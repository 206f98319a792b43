"""JSON out that is always valid: whatever a model emitted or a parser made of it, a response body
or SSE event is strict JSON in valid UTF-8. The fast path is the usual encoder; only a value it
cannot write (a lone surrogate from a JSON escape in model output, a NaN) takes the slow path,
which replaces lone surrogates with U+FFFD and non-finite numbers with null instead of raising
(a raise here would be a 500, or a broken stream)."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticSerializationError
from starlette.responses import JSONResponse

_SURROGATE = re.compile(r"[\ud800-\udfff]")


def dumps(value: BaseModel | Any) -> str:
    """`value` (a pydantic model or plain JSON data) as strict JSON text that encodes to UTF-8."""
    try:
        text = value.model_dump_json() if isinstance(value, BaseModel) else \
            json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        text.encode("utf-8")
        return text
    except (PydanticSerializationError, UnicodeEncodeError, ValueError):
        data = value.model_dump() if isinstance(value, BaseModel) else value
        return json.dumps(_clean(data), ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _clean(value: Any) -> Any:
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {_clean(str(k)): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class SafeJSONResponse(JSONResponse):
    """A JSONResponse whose body is `dumps(content)`: a model or plain data, never a 500 on output."""

    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8")
