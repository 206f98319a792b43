"""The internal routes' credential checked before FastAPI routes the request. A caller without the
route's secret (a tenant's key, a forged or missing one) then costs the server a header comparison
and, when it carries a key, the lookup that tells 401 from 403: not FastAPI's routing, dependency
resolution and exception handling. A flood of such requests held the GIL ~0.6 ms each, which the
engine's step waited for (bench/RESULTS.md, "M3.2 hostile tenant: SCHED_IDLE compile workers ...").
The handlers check again (require_secret): the gate only answers refusals sooner."""

from __future__ import annotations

from collections.abc import Mapping

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from ferrylm.http.errors import APIError
from ferrylm.server.internal_auth import InternalCredential, check_secret
from ferrylm.server.state import ServerState


class InternalRouteGate:
    """ASGI middleware: a POST to one of `routes` (path → its credential) is refused here unless it
    carries that credential's secret; everything else passes through untouched."""

    def __init__(self, app: ASGIApp, state: ServerState, routes: Mapping[str, InternalCredential]):
        self.app, self.state, self.routes = app, state, dict(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        credential = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" \
            else None
        if credential is not None:
            try:
                await check_secret(Headers(scope=scope), self.state, credential)
            except APIError as err:
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
