"""Structured logging: one JSON object per line, so log pipelines can filter by request id."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import TextIO

# Attributes every LogRecord has; anything else on a record came from `extra=` and is logged as a field.
# uvicorn adds `color_message` (the same text with ANSI colours): noise in JSON.
_STANDARD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "color_message"}


class JsonFormatter(logging.Formatter):
    """Formats a record as {"ts", "level", "logger", "msg", ...extra fields} on one line."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                data[key] = value
        if record.exc_info:
            data["exc"] = self.formatException(record.exc_info)
        return json.dumps(data, default=str, ensure_ascii=False)


def configure_logging(level: str = "info", stream: TextIO | None = None) -> None:
    """Route the root logger (and uvicorn's, which would otherwise print plain text) through JSON."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
    # The server writes its own access line carrying the request id; uvicorn's would duplicate it.
    logging.getLogger("uvicorn.access").disabled = True
    # httpx logs every request at INFO; the gateway's health polls would flood the log.
    logging.getLogger("httpx").setLevel(logging.WARNING)
