"""The dashboard's routes, the same on both front doors: GET /dashboard (the page),
/dashboard/static/{file} (its script and style, package data), /dashboard/data (the sampler's JSON).
The page and its assets hold no data and are public; /dashboard/data is guarded by `authorize`
(each app passes its /metrics rule: open unless --metrics-require-auth)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib.resources import files

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ferrylm.http.errors import APIError
from ferrylm.observability.dashboard.sampler import DashboardSampler

CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8"}
ASSETS = ("dashboard.js", "dashboard.css")
# Everything the page loads comes from this server: no CDN, no inline script.
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:", "Cache-Control": "no-cache",
                "X-Content-Type-Options": "nosniff"}


def _static(name: str) -> Response:
    body = files("ferrylm.observability.dashboard").joinpath("static", name).read_bytes()
    suffix = name[name.rfind("."):]
    return Response(body, media_type=CONTENT_TYPES[suffix], headers=PAGE_HEADERS)


def dashboard_router(sampler_of: Callable[[Request], DashboardSampler],
                     authorize: Callable[[Request], Awaitable[None]]) -> APIRouter:
    """The routes, reading the sampler the app's state owns; `authorize` raises (401) or returns."""
    router = APIRouter(include_in_schema=False)

    async def page() -> Response:
        return _static("index.html")

    async def asset(name: str) -> Response:
        if name not in ASSETS:
            raise APIError(404, f"No dashboard asset {name!r}.", code="not_found")
        return _static(name)

    async def data(request: Request) -> JSONResponse:
        await authorize(request)
        return JSONResponse(sampler_of(request).to_json(), headers={"Cache-Control": "no-store"})

    router.add_api_route("/dashboard", page, methods=["GET"])
    router.add_api_route("/dashboard/static/{name}", asset, methods=["GET"])
    router.add_api_route("/dashboard/data", data, methods=["GET"])
    return router
