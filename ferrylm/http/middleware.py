"""Request ids and access logs for every HTTP request (pure ASGI, so streams pass through untouched)."""

from __future__ import annotations

import logging
import re
import time
import uuid

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("ferrylm.access")
_CLIENT_ID = re.compile(r"[\x21-\x7e]{1,256}")  # visible ASCII, no spaces: safe in ids, logs, headers
_QUIET_PATHS = frozenset({"/health", "/ready", "/metrics"})


def client_request_id(scope: Scope) -> str | None:
    """The client's X-Request-Id if it is usable, else None."""
    for name, value in scope.get("headers", []):
        if name == b"x-request-id":
            text = value.decode("latin-1")
            return text if _CLIENT_ID.fullmatch(text) else None
    return None


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class RequestIdMiddleware:
    """Puts the client's X-Request-Id (or None) in `request.state.request_id`, echoes the final id
    (handlers may set one) in the X-Request-Id response header, and logs one access line."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["request_id"] = client_request_id(scope)
        start = time.monotonic()
        status: list[int] = []

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                state["request_id"] = state.get("request_id") or new_request_id("req")
                MutableHeaders(scope=message)["X-Request-Id"] = state["request_id"]
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            level = logging.DEBUG if scope["path"] in _QUIET_PATHS else logging.INFO
            log.log(level, "http", extra={"request_id": state.get("request_id"), "method": scope["method"],
                                          "path": scope["path"], "status": status[0] if status else None,
                                          "ms": round((time.monotonic() - start) * 1000, 1)})
