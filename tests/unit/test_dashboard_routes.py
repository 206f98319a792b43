"""The dashboard's routes on both apps, in process: the page and its assets (content types, no
third-party origin), /dashboard/data under --metrics-require-auth, the sampler started by the
lifespan. The real page in a real browser against real servers: tests/e2e/test_dashboard.py."""

from __future__ import annotations

import re
import time

import pytest
from starlette.testclient import TestClient

from ferrylm.router.app import build_gateway_app
from ferrylm.router.config import GatewayServerConfig, GroupConfig, RouterConfig
from ferrylm.server.app import build_app
from ferrylm.server.config import ServerConfig

ROUTER = RouterConfig((GroupConfig("m", ("http://127.0.0.1:9",), tokenizer="/nonexistent"),), poll_interval_s=30)


def no_engine():
    raise RuntimeError("no model in this test")


def serve_app(**config):
    return build_app(ServerConfig(**config), no_engine)


@pytest.mark.parametrize("make_app", [lambda: serve_app(), lambda: build_gateway_app(GatewayServerConfig(ROUTER))])
def test_page_and_assets_with_their_content_types(make_app):
    with TestClient(make_app()) as http:
        page = http.get("/dashboard")
        assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
        assert "default-src 'self'" in page.headers["content-security-policy"]
        assert not re.search(r"(src|href)=\"(https?:)?//", page.text), "nothing loaded from another origin"
        assert '<table id="tiers">' in page.text, "the KV cache tiers panel"
        for name, kind in (("dashboard.js", "text/javascript"), ("dashboard.css", "text/css")):
            r = http.get(f"/dashboard/static/{name}")
            assert r.status_code == 200 and r.headers["content-type"].startswith(kind) and f"/{name}" in page.text
        assert http.get("/dashboard/static/..%2Fsampler.py").status_code == 404
        assert http.get("/dashboard/static/index.htm").status_code == 404
        assert "/dashboard" not in http.get("/openapi.json").text, "a page, not part of the API"


def test_serve_data_reports_its_own_health_and_takes_the_metrics_credential():
    with TestClient(serve_app(api_key="k", metrics_require_auth=True)) as http:
        assert http.get("/dashboard").status_code == 200, "the page holds no data: public"
        assert http.get("/dashboard/data").status_code == 401
        assert http.get("/dashboard/data", headers={"Authorization": "Bearer nope"}).status_code == 401
        deadline = time.monotonic() + 10
        while True:
            data = http.get("/dashboard/data", headers={"Authorization": "Bearer k"}).json()
            if data["health"] and data["health"][0]["state"].startswith("load failed"):
                break
            assert time.monotonic() < deadline, data
            time.sleep(0.1)
        assert data["source"] == "serve" and data["num_points"] >= 1 and not data["health"][0]["ok"]
        assert set(data["series"]) >= {"t", "ttft_p50", "itl_p99", "generation_tokens_per_s", "num_waiting",
                                       "kv_cache_usage", "prefix_cache_hit_rate", "prefill_tokens_per_step"}
        assert data["kv_tiers"] is None, "no engine reports: no tiers panel (not a panel of zeros)"
    with TestClient(serve_app()) as http:
        assert http.get("/dashboard/data").status_code == 200, "open by default, as /metrics"


def test_gateway_data_lists_each_replica_as_the_router_sees_it():
    with TestClient(build_gateway_app(GatewayServerConfig(ROUTER))) as http:
        data = http.get("/dashboard/data").json()
        assert data["source"] == "gateway" and data["num_points"] >= 1
        [replica] = data["health"]
        assert replica["name"] == "http://127.0.0.1:9" and replica["state"] == "never ready"
        assert replica["ok"] is False and replica["detail"]["group"] == "m"
        assert data["series"]["num_waiting"][-1] is None, "no replica reported: nothing, not zero"
        assert data["kv_tiers"] is None
        assert "itl" in data["notes"]


def test_gateway_data_takes_the_metrics_credential(tmp_path):
    from ferrylm.gateway import GatewayConfig
    from ferrylm.gateway.store import Store

    db = f"sqlite:///{tmp_path / 'state.db'}"
    store = Store(db)
    store.create_tenant("ops")
    _, key = store.create_key("ops")
    store.close()
    locked = build_gateway_app(GatewayServerConfig(ROUTER, GatewayConfig(state_db=db), metrics_require_auth=True))
    with TestClient(locked) as http:
        r = http.get("/dashboard/data")
        assert r.status_code == 401 and "127.0.0.1:9" not in r.text, "replica URLs only with a credential"
        r = http.get("/dashboard/data", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200 and r.json()["health"][0]["name"] == "http://127.0.0.1:9"


def test_every_static_file_is_package_data():
    """An installed wheel carries the page: pyproject's package-data glob covers static/."""
    import tomllib
    from fnmatch import fnmatch
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    static = root / "ferrylm" / "observability" / "dashboard" / "static"
    files = [p.relative_to(static.parent).as_posix() for p in static.iterdir()]
    assert len(files) == 3 and all(any(fnmatch(f, g) for g in globs["ferrylm.observability.dashboard"])
                                   for f in files)
