"""A client that goes away mid-request: the engine request is aborted and its KV blocks freed."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.conftest import requires_smollm2

pytestmark = requires_smollm2

MODEL = "smollm2-135m"
LONG = {"model": MODEL, "messages": [{"role": "user", "content": "Write a very long story about the sea."}],
        "max_tokens": 4000, "ignore_eos": True, "temperature": 0}


def wait_released(server, baseline: dict, within: float) -> dict:
    """Poll /metrics until nothing runs and KV use is back to `baseline`'s; fail after `within` s."""
    deadline = time.monotonic() + within
    while True:
        m = server.metrics()
        if (m["ferrylm:num_requests_running"] == 0 and m["ferrylm:num_requests_waiting"] == 0
                and m["ferrylm:kv_cache_usage_perc"] == baseline["ferrylm:kv_cache_usage_perc"]):
            return m
        if time.monotonic() > deadline:
            pytest.fail(f"not released within {within}s: {m}")
        time.sleep(0.02)


def test_stream_closed_midway_aborts(api_server):
    baseline = api_server.wait_idle()
    with httpx.stream("POST", api_server.url("/v1/chat/completions"), json={**LONG, "stream": True},
                      timeout=60) as r:
        lines = r.iter_lines()
        content_events = 0
        for line in lines:
            if '"content":"' in line and '"role"' not in line:
                content_events += 1
            if content_events == 3:
                break
        during = api_server.metrics()
        assert during["ferrylm:num_requests_running"] == 1
        assert during["ferrylm:kv_cache_usage_perc"] > baseline["ferrylm:kv_cache_usage_perc"]
    closed = time.monotonic()  # leaving the block closes the connection
    after = wait_released(api_server, baseline, within=1.0)
    assert time.monotonic() - closed < 1.0
    assert after["ferrylm:request_success_total{finished_reason=abort}"] >= \
        baseline.get("ferrylm:request_success_total{finished_reason=abort}", 0) + 1


def test_non_streaming_client_timeout_aborts(api_server):
    baseline = api_server.wait_idle()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(api_server.url("/v1/chat/completions"), json=LONG, timeout=httpx.Timeout(60, read=1.5))
    gone = time.monotonic()
    wait_released(api_server, baseline, within=1.0)
    assert time.monotonic() - gone < 1.0
