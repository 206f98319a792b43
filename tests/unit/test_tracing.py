"""Tracing and timing parts without a model: engine phase spans from a RequestTimeline (into the SDK's
InMemorySpanExporter), the timings object, tracing off, the config, and the throughput window."""

from __future__ import annotations

import time

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from ferrylm.config import ConfigError
from ferrylm.observability import tracing as otel
from ferrylm.observability.request_timeline import RequestTimeline
from ferrylm.observability.throughput import ThroughputWindow
from ferrylm.outputs import CompletionOutput, RequestMetrics, RequestOutput


def _final(prompt_len: int, tokens: int, cached: int, metrics: RequestMetrics) -> RequestOutput:
    return RequestOutput("r", None, list(range(prompt_len)), [CompletionOutput(0, "", list(range(tokens)))], True,
                         cached, metrics)


def _timeline(now: float, first_token: bool = True) -> RequestTimeline:
    m = RequestMetrics(arrival_time=now + 0.01, first_scheduled_time=now + 0.03,
                       first_token_time=now + 0.13 if first_token else None, finished_time=now + 0.53,
                       detokenize_time=0.002)
    t = RequestTimeline.of(now, [_final(10, 5, 4, m)])
    assert t is not None
    return t


def test_phase_spans_are_children_with_the_engine_times():
    exporter = InMemorySpanExporter()
    tracing = otel.Tracing.create(None, exporter)
    assert tracing is not None
    now = time.monotonic() - 1.0
    t = _timeline(now)
    parent = tracing.start_server_span("llm_request", {"traceparent": f"00-{'1' * 32}-{'2' * 16}-01"}, now)
    otel.emit_engine_spans(tracing, parent, t)
    parent.set_attributes(otel.timeline_attributes(t))
    tracing.end_span(parent, t.finished)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"queue", "prefill", "decode", "llm_request"}
    root = spans["llm_request"]
    assert format(root.context.trace_id, "032x") == "1" * 32 and format(root.parent.span_id, "016x") == "2" * 16
    durations = {name: (spans[name].end_time - spans[name].start_time) / 1e9 for name in ("queue", "prefill", "decode")}
    assert durations == pytest.approx({"queue": 0.02, "prefill": 0.1, "decode": 0.4}, abs=2e-3)
    assert all(spans[n].parent.span_id == root.context.span_id for n in ("queue", "prefill", "decode"))
    assert spans["decode"].attributes["ferrylm.detokenize_seconds"] == 0.002
    assert root.attributes["gen_ai.latency.time_to_first_token"] == pytest.approx(0.13)
    assert root.attributes["gen_ai.latency.time_in_queue"] == pytest.approx(0.02)


def test_a_phase_that_never_began_is_left_out():
    exporter = InMemorySpanExporter()
    tracing = otel.Tracing.create(None, exporter)
    assert tracing is not None
    now = time.monotonic()
    root = tracing.start_server_span("llm_request", {}, now)
    otel.emit_engine_spans(tracing, root, _timeline(now, first_token=False))
    assert [s.name for s in exporter.get_finished_spans()] == ["queue"]


def test_timings_follow_llama_cpp_names():
    t = _timeline(100.0).timings()
    assert (t["prompt_n"], t["cache_n"], t["predicted_n"]) == (6, 4, 4)
    assert t["prompt_ms"] == pytest.approx(100.0) and t["predicted_ms"] == pytest.approx(400.0)
    assert t["predicted_per_token_ms"] == pytest.approx(100.0) and t["predicted_per_second"] == pytest.approx(10.0)
    assert t["queue_ms"] == pytest.approx(20.0) and t["ttft_ms"] == pytest.approx(130.0)
    assert t["total_ms"] == pytest.approx(530.0)


def test_tracing_off_is_nothing_and_bad_config_is_refused():
    assert otel.Tracing.create(None) is None
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        otel.TracingConfig("http://collector:4318/v1/traces", protocol="http/json")


def test_throughput_window_counts_the_last_seconds_only():
    w = ThroughputWindow(10, now=0.0)
    w.add(20, now=1.5)
    assert w.rate(now=2.0) == pytest.approx(10.0)  # 20 tokens over the 2 s since start
    w.add(30, now=9.2)
    assert w.rate(now=10.5) == pytest.approx(5.0)  # 50 over the full 10 s window
    assert w.rate(now=15.0) == pytest.approx(3.0)  # the second-1 bucket fell out
