"""The standalone gateway's own edges: the drain guard on in-flight requests, bodies that decode
but cannot be forwarded, and --metrics-require-auth on /metrics. In process; the e2e tests run
the same against real processes."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.testclient import TestClient

from ferrylm.config import ConfigError
from ferrylm.gateway import GatewayConfig
from ferrylm.gateway.store import Store
from ferrylm.http.errors import APIError
from ferrylm.load_report import LoadReport
from ferrylm.router.app import build_gateway_app
from ferrylm.router.config import GatewayServerConfig, GroupConfig, RouterConfig
from ferrylm.router.inflight import InFlight
from ferrylm.server.config import ServerConfig

ROUTER = RouterConfig((GroupConfig("m", ("http://127.0.0.1:9",), tokenizer="/nonexistent"),), poll_interval_s=30)


def test_a_drain_abort_cancels_the_work_and_answers_503():
    cleaned = []

    async def slow():
        try:
            await asyncio.sleep(30)
        finally:
            cleaned.append(True)

    async def run():
        inflight = InFlight()
        task = asyncio.create_task(inflight.guard(slow()))
        await asyncio.sleep(0.01)
        inflight.abort()
        with pytest.raises(APIError) as err:
            await task
        assert await InFlight().guard(asyncio.sleep(0, result=7)) == 7
        with pytest.raises(APIError):
            await inflight.guard(asyncio.sleep(0))  # aborted already: nothing starts
        return err.value

    err = asyncio.run(run())
    assert (err.status, err.code, err.type) == (503, "server_shutting_down", "server_error")
    assert cleaned == [True], "the upstream try was cancelled and its cleanup ran"


def test_a_cancelled_guard_cancels_its_work():
    cleaned = []

    async def slow():
        try:
            await asyncio.sleep(30)
        finally:
            cleaned.append(True)

    async def run():
        task = asyncio.create_task(InFlight().guard(slow()))
        await asyncio.sleep(0.01)
        task.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert cleaned == [True]


@pytest.mark.parametrize("body", [
    '{"model":"m","messages":[{"role":"user","content":"hi"}],"x":' + "[" * 100_000 + "]" * 100_000 + "}",
    '{"model":"m","messages":[{"role":"user","content":"\\ud800"}]}',
    '{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a\\udfffb"}]}]}',
    '{"model":"m","prompt":"\\udc00"}',
    '{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":NaN}',
])
def test_bodies_that_cannot_be_forwarded_are_400(body):
    with TestClient(build_gateway_app(GatewayServerConfig(ROUTER))) as http:
        path = "/v1/completions" if '"prompt"' in body else "/v1/chat/completions"
        r = http.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
        ok = http.post("/v1/completions", content='{"model":"m","prompt":"\\ud83d\\ude00 a real pair"}')
        assert ok.status_code == 503 and ok.json()["error"]["code"] == "no_healthy_upstream", "decoded, sent on"


def test_metrics_require_auth_on_the_gateway(tmp_path):
    db = f"sqlite:///{tmp_path / 'state.db'}"
    store = Store(db)
    store.create_tenant("ops")
    _, key = store.create_key("ops")
    store.close()
    open_app = build_gateway_app(GatewayServerConfig(ROUTER, GatewayConfig(state_db=db)))
    with TestClient(open_app) as http:
        assert http.get("/metrics").status_code == 200, "open by default (Prometheus scrapes)"
    locked = build_gateway_app(GatewayServerConfig(ROUTER, GatewayConfig(state_db=db), metrics_require_auth=True))
    with TestClient(locked) as http:
        for headers in ({}, {"Authorization": "Bearer fl-nope-nope"}, {"Authorization": "Basic x"}):
            r = http.get("/metrics", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error", r.text
            assert "127.0.0.1:9" not in r.text
        r = http.get("/metrics", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200 and "127.0.0.1:9" in r.text
        assert http.get("/health").status_code == 200, "liveness stays open"


def test_metrics_require_auth_needs_something_to_check():
    with pytest.raises(ConfigError):
        GatewayServerConfig(ROUTER, None, metrics_require_auth=True)
    with pytest.raises(ConfigError):
        ServerConfig(metrics_require_auth=True)
    ServerConfig(api_key="k", metrics_require_auth=True)
    ServerConfig(gateway=GatewayConfig(state_db="sqlite://"), metrics_require_auth=True)


def test_the_poller_sends_the_upstream_key_to_load():
    from ferrylm.router.poller import HealthPoller
    from ferrylm.router.registry import ReplicaRegistry

    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen[request.url.path] = request.headers.get("authorization")
        if request.url.path == "/load":
            return httpx.Response(200, json=LoadReport.empty().to_json() | {"max_model_len": 4096, "block_size": 16})
        return httpx.Response(200, json={"status": "ok"})

    config = RouterConfig((GroupConfig("m", ("http://a",)),), upstream_api_key="sk-up")
    registry = ReplicaRegistry(config)

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await HealthPoller(registry, config, client).poll_once()

    asyncio.run(run())
    assert seen["/load"] == "Bearer sk-up"
    assert registry.replicas()[0].max_model_len == 4096


def test_require_credential_takes_what_v1_takes():
    from types import SimpleNamespace

    from ferrylm.gateway.errors import AuthError
    from ferrylm.gateway.ops_auth import require_credential

    class Authenticator:
        def authenticate(self, authorization):
            if authorization != "Bearer fl-good":
                raise AuthError()

    def gateway(require_auth: bool):
        return SimpleNamespace(config=SimpleNamespace(require_auth=require_auth), authenticator=Authenticator())

    def allowed(authorization, api_key, gw) -> bool:
        headers = {"authorization": authorization} if authorization else {}
        try:
            asyncio.run(require_credential(headers, api_key, gw))
            return True
        except AuthError as e:
            assert e.status == 401
            return False

    assert [allowed(h, "sk-static", None) for h in (None, "Bearer sk-static", "Bearer sk-other")] == \
        [False, True, False]
    assert allowed("Bearer sk-static", "sk-static", gateway(False)), "--api-key alone, as on /v1"
    assert not allowed("Bearer sk-static", "sk-static", gateway(True)), "--require-auth too: both, as on /v1"
    assert [allowed(h, None, gateway(False)) for h in (None, "Bearer fl-good", "Bearer fl-bad")] == \
        [False, True, False], "an open gateway still wants a real credential here"
