"""/dashboard in a real headless Chromium against real processes: `ferrylm serve` after real
requests through the openai client (every chart has points, the JS wrote its latest values into the
DOM, the screenshot (bench/dashboard.png with FERRYLM_UPDATE_SCREENSHOT=1) is a real, non-blank
picture with the charts' lines), and
`ferrylm gateway` in front of it and of a dead replica (each replica's health as the router sees it);
the KV cache tiers panel as the page renders it, from the real server (no host or disk tier: "off") and
from a server whose engine reports are scripted (every tier on, known rates and latency)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
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


def tier_rows(dom: str) -> dict[str, tuple[str, list[str]]]:
    """The KV cache tiers table as drawn: tier -> (data-on, the cells' text)."""
    rows = re.finditer(r'<tr data-tier="(\w+)" data-on="(true|false)">(.*?)</tr>', dom)
    return {m.group(1): (m.group(2), re.findall(r"<td[^>]*>([^<]*)</td>", m.group(3))) for m in rows}


@contextlib.contextmanager
def served(app) -> Iterator[str]:
    """`app` under uvicorn in a thread; its base URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


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
    device, host, disk = data["kv_tiers"]["tiers"]
    assert device["on"] and 0 <= device["occupancy"] <= 1 and device["hit_tokens"] > 0, "turns 2, 3 hit the cache"
    assert host["on"] is False and disk["on"] is False and host["occupancy"] is None, "no tier flags: off"

    dom = browse(chromium, api_server.url("/dashboard"), tmp_path, "--dump-dom")
    status = re.search(r'<div id="status"[^>]*data-updates="(\d+)"[^>]*data-num-points="(\d+)"', dom)
    assert status and int(status.group(1)) >= 2, "the page polled more than once"
    for name in CHARTS:
        points, latest = chart(dom, name)
        assert points > 0, (name, latest)
    assert chart(dom, "ttft")[1]["ttft_p99"] > 0 and chart(dom, "itl")[1]["itl_p50"] > 0
    assert chart(dom, "kv")[1]["kv_cache_usage"] is not None
    assert health_rows(dom) == {"this server": "true"}
    tiers = tier_rows(dom)
    assert tiers["device"][0] == "true" and re.fullmatch(r"[\d,]+ / [\d,]+ \([\d.]+ %\)", tiers["device"][1][1])
    assert tiers["host"] == ("false", ["host (CPU)", "off"]) and tiers["disk"] == ("false", ["disk", "off"])
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
    from ferrylm.gateway import GatewayConfig
    from ferrylm.router.app import build_gateway_app
    from ferrylm.router.config import GatewayServerConfig, GroupConfig, RouterConfig

    router = RouterConfig((GroupConfig("m", ("http://127.0.0.1:9",), tokenizer="/nonexistent"),), poll_interval_s=30)
    app = build_gateway_app(GatewayServerConfig(router, GatewayConfig(state_db=f"sqlite:///{tmp_path / 's.db'}"),
                                                metrics_require_auth=True))
    with served(app) as url:
        dom = browse(chromium, f"{url}/dashboard", tmp_path, "--dump-dom")
        assert re.search(r'<form id="auth">', dom), "the key form is shown (no hidden attribute)"
        assert "a credential is needed" in dom and "127.0.0.1:9" not in dom


def scripted_engine() -> Callable:
    """Readings as from an engine with every tier on, one a (monotonic) second: per second 100 prompt
    tokens hit, 32 of them loaded back from host memory and 16 read up from disk; 4 blocks copied to
    host and 2 back, 2 files written and 1 read in 4 ms (64 KiB each); one file lost long ago."""
    from ferrylm.load_report import LoadReport
    from ferrylm.observability.dashboard.readings import counters_of, gauges_of
    from ferrylm.observability.dashboard.sampler import Health, Reading
    from ferrylm.observability.dashboard.tiers import tier_counters

    seconds = itertools.count()

    def read() -> Reading:
        k = next(seconds)
        load = dataclasses.replace(
            LoadReport.empty(), kv_blocks_used=300, kv_blocks_total=400, prefix_cache_queries=200 * k,
            prefix_cache_hits=100 * k, kv_offload_hit_tokens=32 * k, kv_offload_blocks_out=4 * k,
            kv_offload_blocks_in=2 * k, kv_offload_blocks_used=60, kv_offload_blocks_total=120,
            kv_offload_disk_hit_tokens=16 * k, kv_offload_disk_blocks_written=2 * k, kv_offload_disk_blocks_read=k,
            kv_offload_disk_blocks_lost=1, kv_offload_disk_bytes_written=2 * k * 65536,
            kv_offload_disk_bytes_read=k * 65536, kv_offload_disk_read_seconds=0.004 * k,
            kv_offload_disk_blocks_used=500, kv_offload_disk_blocks_total=1000)
        return Reading(wall=time.time(), mono=float(k), counters=counters_of(load), gauges=gauges_of(load), ttft=None,
                       itl=None, health=(Health("this server", "ok", True, {}),), tiers=tier_counters([load], [load]))

    return read


def test_tiers_panel_draws_every_tier(chromium, tmp_path):
    """The page's KV cache tiers table from known figures: occupancy, hit rates, moves, latency, lost."""
    from ferrylm.server.app import build_app
    from ferrylm.server.config import ServerConfig

    def no_engine():
        raise RuntimeError("the readings are scripted")

    app = build_app(ServerConfig(), no_engine)
    app.state.ferry.dashboard.read = scripted_engine()
    with served(app) as url:
        deadline = time.monotonic() + 15
        while httpx.get(f"{url}/dashboard/data", timeout=10).json()["num_points"] < 3:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        dom = browse(chromium, f"{url}/dashboard", tmp_path, "--dump-dom")
    tiers = tier_rows(dom)
    assert list(tiers) == ["device", "host", "disk"] and all(on == "true" for on, _ in tiers.values())
    name, occupancy, hits, rate, *moves = tiers["device"][1]
    assert (name, occupancy, rate, moves) == ("device pool", "300 / 400 (75.0 %)", "68 tok/s", ["–"] * 6)
    assert re.fullmatch(r"[\d,]+", hits) and int(hits.replace(",", "")) % 68 == 0
    name, occupancy, _, rate, out, back, *rest = tiers["host"][1]
    assert (name, occupancy, rate, rest) == ("host (CPU)", "60 / 120 (50.0 %)", "32 tok/s", ["–"] * 4)
    assert out.endswith(" (4/s)") and back.endswith(" (2/s)")
    name, occupancy, _, rate, out, back, bytes_out, bytes_in, latency, lost = tiers["disk"][1]
    assert (name, occupancy, rate, latency, lost) == ("disk", "500 / 1,000 (50.0 %)", "16 tok/s",
                                                      "4.00 ms (all: 4.00 ms)", "1")
    assert out.endswith(" (2/s)") and back.endswith(" (1/s)")
    assert bytes_out.endswith(" (128.0 KiB/s)") and bytes_in.endswith(" (64.0 KiB/s)")
    assert re.search(r'<span id="tiers-window">\(rates over the last \d+ s\)</span>', dom)
