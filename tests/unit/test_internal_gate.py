"""The internal routes' gate answers a refused caller before the app sees the request (the same
401/403 bodies the handlers give: tests/e2e/test_kv_transfer_serve.py, test_lora_serve.py), and
passes the secret, other methods and other paths through untouched."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx

from ferrylm.server.internal_auth import KV_TRANSFER, LORA_ADMIN
from ferrylm.server.internal_gate import InternalRouteGate

SECRET, LORA_SECRET, API_KEY = "kv-transfer-secret-0123456789", "lora-admin-secret-0123456789", "sk-api-key"


def _run(method: str, path: str, token: str | None) -> tuple[httpx.Response, list[str]]:
    reached: list[str] = []

    async def app(scope, receive, send) -> None:
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"handler"})

    config = SimpleNamespace(kv_transfer_key=SECRET, lora_admin_key=LORA_SECRET, api_key=API_KEY)
    gate = InternalRouteGate(app, SimpleNamespace(config=config, gateway=None),  # type: ignore[arg-type]
                             {"/v1/kv/export": KV_TRANSFER, "/v1/load_lora_adapter": LORA_ADMIN})

    async def call() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gate), base_url="http://t") as client:
            headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
            return await client.request(method, path, headers=headers, json={})

    return asyncio.run(call()), reached


def test_a_caller_without_the_routes_secret_is_refused_before_the_app() -> None:
    for path, what in (("/v1/kv/export", "KV transfer"), ("/v1/load_lora_adapter", "Loading LoRA adapters")):
        r, reached = _run("POST", path, API_KEY)  # a key /v1 accepts: 403
        assert r.status_code == 403 and not reached
        assert r.json()["error"]["code"] == "permission_denied" and what in r.json()["error"]["message"]
        r, reached = _run("POST", path, "sk-wrong")  # a key /v1 refuses too: 401
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key" and not reached
        r, reached = _run("POST", path, None)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer" and not reached
        assert "its own credential" in r.json()["error"]["message"]
    r, reached = _run("POST", "/v1/kv/export", LORA_SECRET)  # another internal API's secret is not this one's
    assert r.status_code == 401 and not reached


def test_the_secret_other_methods_and_other_paths_reach_the_app() -> None:
    for method, path, token in (("POST", "/v1/kv/export", SECRET), ("POST", "/v1/load_lora_adapter", LORA_SECRET),
                                ("GET", "/v1/kv/export", None), ("POST", "/v1/chat/completions", None)):
        r, reached = _run(method, path, token)
        assert r.status_code == 200 and r.text == "handler" and reached == [path]
