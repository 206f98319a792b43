"""/metrics: Prometheus text with vLLM's metric names under `ferrylm:`, labelled by model_name."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import requires_smollm2

pytestmark = requires_smollm2

EXPECTED = {
    "histogram": ["time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                  "request_queue_time_seconds"],
    "counter": ["prompt_tokens", "generation_tokens", "prefix_cache_queries", "prefix_cache_hits",
                "num_preemptions", "request_success"],
    "gauge": ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"],
}


def test_metric_names_types_and_labels(api_server, client):
    client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Hello"}],
                                   temperature=0, max_tokens=3)
    client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Hello"}],
                                   temperature=0, max_tokens=3)  # same prompt: a prefix-cache hit
    r = httpx.get(api_server.url("/metrics"), timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    for kind, names in EXPECTED.items():
        for name in names:
            family = families["ferrylm:" + name]
            assert family.type == kind, name
            assert family.samples and all(s.labels.get("model_name") == "smollm2-135m" for s in family.samples)
    values = api_server.metrics()
    assert values["ferrylm:e2e_request_latency_seconds_count"] >= 2
    assert values["ferrylm:inter_token_latency_seconds_count"] >= 4
    assert values["ferrylm:prefix_cache_hits_total"] > 0
    assert values["ferrylm:prompt_tokens_total"] >= values["ferrylm:prefix_cache_queries_total"] > 0
    assert 0 <= values["ferrylm:kv_cache_usage_perc"] <= 1
