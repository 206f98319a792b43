"""/dashboard in a real headless Chromium against real processes: `ferrylm serve` after real
requests through the openai client (every chart has points, the JS wrote its latest values into the
DOM, the screenshot (bench/dashboard.png with FERRYLM_UPDATE_SCREENSHOT=1) is a real, non-blank
picture with the charts' lines), and
`ferrylm gateway` in front of it and of a dead replica (each replica's health as the router sees it)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.server_process import ServerProcess, free_port

# The committed picture is refreshed only when asked (FERRYLM_UPDATE_SCREENSHOT=1), so `make test`
# leaves the tree clean; otherwise the screenshot goes to the test's temp dir and is checked there.
BENCH_SCREENSHOT = Path(__file__).resolve().parents[2] / "bench" / "dashboard.png"
CHARTS = ("ttft", "itl", "throughput", "queue", "kv", "prefix", "batch", "health")
LINE_BLUE = (0x1F, 0x6F, 0xEB)  # the first series' colour in dashboard.js
SYSTEM = "You are a ferry timetable assistant. Answer briefly and politely, in one sentence. " * 6


@pytest.fixture(scope="module")
def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.skip("chromium is not installed (make setup installs it)")
    return path


def browse(chromium: str, url: str, tmp: Path, *mode: str) -> str:
    """Load `url` headless, let its script run ~4 s of virtual time (three polls), then `mode`."""
    cmd = [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
           f"--user-data-dir={tmp / 'profile'}", "--window-size=1400,1000", "--hide-scrollbars",
           "--virtual-time-budget=4000", *mode, url]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def chart(dom: str, name: str) -> tuple[int, dict]:
    """What the chart's script wrote into its <figure>: points drawn and the latest values."""
    tag = re.search(rf'<figure[^>]*id="chart-{name}"[^>]*>', dom)
    assert tag, f"chart {name} missing"
    points = re.search(r'data-points="(\d+)"', tag.group(0))
    latest = re.search(r'data-latest="([^"]*)"', tag.group(0))
    assert points and latest, f"chart {name} was never drawn: {tag.group(0)}"
    return int(points.group(1)), json.loads(latest.group(1).replace("&quot;", '"'))


def health_rows(dom: str) -> dict[str, str]:
    return {m.group(2): m.group(1) for m in re.finditer(r'<tr data-ok="(true|false)" data-name="([^"]+)"', dom)}


def send_requests(server: ServerProcess) -> None:
    client = server.client()
    for i in range(3):  # the same long system prompt: the second and third hit the prefix cache
        client.chat.completions.create(model="smollm2-135m", max_tokens=12, temperature=0,
                                       messages=[{"role": "system", "content": SYSTEM},
                                                 {"role": "user", "content": f"When is ferry {i}?"}])
    stream = client.completions.create(model="smollm2-135m", prompt="The harbour at dawn", max_tokens=24,
                                       temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices)


def wait_for_point(server: ServerProcess, series: str) -> dict:
    """/dashboard/data once its latest point has `series` (readings come every second)."""
    deadline = time.monotonic() + 15
    while True:
        data = httpx.get(server.url("/dashboard/data"), timeout=10).json()
        if data["series"][series] and data["series"][series][-1] is not None:
            return data
        assert time.monotonic() < deadline, data
        time.sleep(0.3)


def test_serve_dashboard_draws_live_charts(api_server, chromium, tmp_path):
    send_requests(api_server)
    data = wait_for_point(api_server, "ttft_p50")
    s = data["series"]
    assert data["source"] == "serve" and data["health"][0]["ok"] is True
    assert any(v for v in s["generation_tokens_per_s"] if v) and any(v for v in s["decode_tokens_per_step"] if v)
    assert any(v for v in s["prefill_tokens_per_step"] if v) and any(v for v in s["prefix_cache_hit_rate"] if v)
    assert data["summary"]["itl_p50"] is not None and 0 < data["summary"]["ttft_p50"] < 60

    dom = browse(chromium, api_server.url("/dashboard"), tmp_path, "--dump-dom")
    status = re.search(r'<div id="status"[^>]*data-updates="(\d+)"[^>]*data-num-points="(\d+)"', dom)
    assert status and int(status.group(1)) >= 2, "the page polled more than once"
    for name in CHARTS:
        points, latest = chart(dom, name)
        assert points > 0, (name, latest)
    assert chart(dom, "ttft")[1]["ttft_p99"] > 0 and chart(dom, "itl")[1]["itl_p50"] > 0
    assert chart(dom, "kv")[1]["kv_cache_usage"] is not None
    assert health_rows(dom) == {"this server": "true"}
    assert dom.count("<polyline") >= len(CHARTS), "a line per chart at least"

    screenshot = BENCH_SCREENSHOT if os.environ.get("FERRYLM_UPDATE_SCREENSHOT") == "1" else tmp_path / "dashboard.png"
    screenshot.unlink(missing_ok=True)
    browse(chromium, api_server.url("/dashboard"), tmp_path, f"--screenshot={screenshot}")
    from PIL import Image

    with Image.open(screenshot) as png:
        assert png.format == "PNG" and png.size == (1400, 1000)
        colors = png.convert("RGB").getcolors(1400 * 1000)  # (count, colour) pairs
    background = max(count for count, _ in colors)
    assert 1400 * 1000 - background > 0.05 * 1400 * 1000, "mostly blank"
    blue = sum(count for count, rgb in colors if all(abs(a - b) < 40 for a, b in zip(rgb, LINE_BLUE)))
    assert blue > 200, f"only {blue} pixels of the charts' lines"


def test_gateway_dashboard_shows_each_replica_as_the_router_sees_it(api_server, chromium, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    gw = ServerProcess("--upstream", api_server.base_url, "--upstream", dead, "--poll-interval", "0.25",
                       command="gateway")
    try:
        gw.wait_ready(60)
        client = gw.client()
        for _ in range(2):  # streamed: the router times the first token of streams
            stream = client.chat.completions.create(model="smollm2-135m", max_tokens=4, temperature=0, stream=True,
                                                    messages=[{"role": "user", "content": "Hello?"}])
            assert list(stream)
        data = wait_for_point(gw, "ttft_p50")
        assert data["source"] == "gateway" and data["series"]["itl_p50"][-1] is None and data["notes"]["itl"]
        dom = browse(chromium, gw.url("/dashboard"), tmp_path, "--dump-dom")
        assert health_rows(dom) == {api_server.base_url: "true", dead: "false"}
        assert re.search(r'data-source="gateway"', dom)
        for name in ("ttft", "queue", "kv", "throughput", "health"):
            assert chart(dom, name)[0] > 0, name
        assert "not measured by the gateway" in dom
    finally:
        assert gw.stop() == 0, gw.log_tail()


def test_locked_data_makes_the_page_ask_for_a_credential(chromium, tmp_path):
    """--metrics-require-auth: the page loads, /dashboard/data answers 401, the page shows the key form."""
    import threading

    import uvicorn

    from ferrylm.gateway import GatewayConfig
    from ferrylm.router.app import build_gateway_app
    from ferrylm.router.config import GatewayServerConfig, GroupConfig, RouterConfig

    router = RouterConfig((GroupConfig("m", ("http://127.0.0.1:9",), tokenizer="/nonexistent"),), poll_interval_s=30)
    app = build_gateway_app(GatewayServerConfig(router, GatewayConfig(state_db=f"sqlite:///{tmp_path / 's.db'}"),
                                                metrics_require_auth=True))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        dom = browse(chromium, f"http://127.0.0.1:{port}/dashboard", tmp_path, "--dump-dom")
        assert re.search(r'<form id="auth">', dom), "the key form is shown (no hidden attribute)"
        assert "a credential is needed" in dom and "127.0.0.1:9" not in dom
    finally:
        server.should_exit = True
        thread.join(10)
