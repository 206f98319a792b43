"""Per-tenant latency histograms with bounded labels, and the gateway's observation of a relayed
stream (per-tenant TTFT / ITL / e2e, its span and the traceparent it forwards), against a scripted
replica (httpx.MockTransport); tests/e2e/test_tracing.py runs the same code against real processes."""

from __future__ import annotations

import asyncio
import json
import time

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from ferrylm.observability.tenant_metrics import TenantLabels, TenantLatency, TenantMetricsConfig
from ferrylm.observability.tracing import Tracing
from ferrylm.router.observation import GatewayObservation
from ferrylm.router.policies import RouteContext
from tests.gateway.test_routing_dispatch import ROLE, STOP, TOKEN, sse, world

CLIENT_TRACE = "0af7651916cd43dd8440000000000001"
CLIENT_PARENT = "00f067aa0ba90002"


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def test_named_tenants_keep_their_label_and_the_rest_fold_into_other():
    labels = TenantLabels(TenantMetricsConfig(names=("acme", "globex")))
    assert [labels(t) for t in ("acme", "initech", "globex", "other")] == ["acme", "other", "globex", "other"]


def test_first_tenants_seen_get_a_series_until_the_budget_is_spent():
    labels = TenantLabels(TenantMetricsConfig(max_tenants=2))
    assert [labels(t) for t in ("b", "a", "c", "b", "d", "a")] == ["b", "a", "other", "b", "other", "a"]
    registry = CollectorRegistry()
    latency = TenantLatency(registry, TenantMetricsConfig(max_tenants=1))
    latency.e2e("m", "first", 0.4)
    latency.e2e("m", "second", 0.4)
    latency.e2e("m", "third", 0.4)
    e2e = "ferrylm:tenant_e2e_request_latency_seconds_count"
    assert sample(registry, e2e, model_name="m", tenant="first") == 1
    assert sample(registry, e2e, model_name="m", tenant="other") == 2


def test_relayed_stream_feeds_the_tenant_histograms_the_span_and_the_forwarded_traceparent():
    timings = {"prompt_n": 5, "predicted_n": 2}
    usage_chunk = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}, "timings": timings}
    forwarded: list[str] = []

    def replica(request):
        forwarded.append(request.headers["traceparent"])
        return __import__("httpx").Response(200, content=sse(ROLE, TOKEN, TOKEN, TOKEN, STOP, usage_chunk, "[DONE]"))

    exporter = InMemorySpanExporter()
    tracing = Tracing.create(None, exporter)
    assert tracing is not None

    async def go():
        registry, dispatcher, client = world(replica)
        group = registry.groups["m"]
        client_headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"}
        obs = GatewayObservation(tracing, dispatcher.metrics, client_headers, "m", "acme", "req-1", time.monotonic())
        headers = dict(client_headers)
        obs.inject(headers)
        d = await dispatcher.dispatch(group, "/v1/chat/completions", {"stream": True}, headers,
                                      RouteContext(5, 16), stream=True)
        obs.replica(d.replica.url)

        async def settle(status, prompt, completion, cached=0):
            obs.end(status, prompt, completion)

        from ferrylm.router.relay import StreamRelay
        out = [chunk async for chunk in StreamRelay(d, False, settle, dispatcher.metrics, lambda _r: None,
                                                     observation=obs)]
        await client.aclose()
        return dispatcher.metrics.registry, out

    registry, out = asyncio.run(go())
    tenant = {"model_name": "m", "tenant": "acme"}
    assert sample(registry, "ferrylm:tenant_time_to_first_token_seconds_count", **tenant) == 1
    assert sample(registry, "ferrylm:tenant_inter_token_latency_seconds_count", **tenant) == 2
    assert sample(registry, "ferrylm:tenant_e2e_request_latency_seconds_count", **tenant) == 1
    # the client did not ask for usage, but asked for timings: the chunk goes on without the usage
    closing = [json.loads(c[6:]) for c in out if b"timings" in c]
    assert closing == [{"choices": [], "usage": None, "timings": timings}]
    (span,) = exporter.get_finished_spans()
    assert span.name == "gateway_request" and format(span.context.trace_id, "032x") == CLIENT_TRACE
    assert format(span.parent.span_id, "016x") == CLIENT_PARENT
    assert forwarded == [f"00-{CLIENT_TRACE}-{format(span.context.span_id, '016x')}-01"]
    attrs = span.attributes
    assert attrs["ferrylm.tenant"] == "acme" and attrs["ferrylm.replica"] in ("http://a", "http://b")
    assert attrs["http.response.status_code"] == 200 and attrs["gen_ai.usage.completion_tokens"] == 3
