"""OpenTelemetry traces end to end: a real `ferrylm gateway` in front of a real `ferrylm serve`, both
given --otlp-traces-endpoint pointing at a tiny OTLP/HTTP receiver in this test (protobuf decoded
with opentelemetry-proto). Requests carry a client `traceparent`: each must become one trace with
the client's trace id, gateway_request → llm_request → queue / prefill / decode, parent links
intact. Also the opt-in `timings` object and tokens_per_second_per_device on the replica."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.e2e.server_process import ServerProcess

MODEL = "smollm2-135m"
SERVE_ARGS = ("--dtype", "float32", "--max-num-seqs", "8", "--max-num-batched-tokens", "512")
OTLP_ENV = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}


class OTLPReceiver:
    """POST /v1/traces (OTLP/HTTP protobuf): every span received, flattened to a dict."""

    def __init__(self):
        self.spans: list[dict] = []
        lock = threading.Lock()
        spans = self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                with lock:
                    for rs in request.resource_spans:
                        service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
                        for ss in rs.scope_spans:
                            for s in ss.spans:
                                spans.append({"service": service, "name": s.name, "trace_id": s.trace_id.hex(),
                                              "span_id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                                              "start": s.start_time_unix_nano, "end": s.end_time_unix_nano,
                                              "attrs": {a.key: _value(a.value) for a in s.attributes}})
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def trace(self, trace_id: str, count: int, timeout: float = 20.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [s for s in list(self.spans) if s["trace_id"] == trace_id]
            if len(found) >= count:
                return found
            time.sleep(0.1)
        raise AssertionError(f"trace {trace_id}: {[s['name'] for s in self.spans if s['trace_id'] == trace_id]}")


def _value(v):
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """Both with their gateway policy on (no auth: every caller is the `anonymous` tenant)."""
    receiver = OTLPReceiver()
    state = tmp_path_factory.mktemp("tracing")
    replica = ServerProcess(*SERVE_ARGS, "--state-db", f"sqlite:///{state / 'replica.db'}",
                            "--otlp-traces-endpoint", receiver.url, env=OTLP_ENV)
    try:
        replica.wait_ready()
        gateway = ServerProcess("--upstream", replica.base_url, "--poll-interval", "0.25",
                                "--state-db", f"sqlite:///{state / 'gateway.db'}",
                                "--otlp-traces-endpoint", receiver.url, command="gateway", env=OTLP_ENV)
        gateway.wait_ready(60)
        yield receiver, replica, gateway
        assert gateway.stop() == 0, gateway.log_tail()
    finally:
        replica.stop()
        receiver.server.shutdown()


def _traceparent(trace_id: str, parent: str) -> dict[str, str]:
    return {"traceparent": f"00-{trace_id}-{parent}-01"}


def _by_name(spans: list[dict]) -> dict[str, dict]:
    names = [s["name"] for s in spans]
    assert len(names) == len(set(names)), names
    return {s["name"]: s for s in spans}


def test_gateway_and_replica_spans_form_one_trace_with_the_clients_id(traced):
    receiver, replica, gateway = traced
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", gateway.url("/v1/chat/completions"), json=body, headers=_traceparent(trace_id, parent),
                      timeout=60) as r:
        assert r.status_code == 200
        assert r.read().endswith(b"data: [DONE]\n\n")
    spans = _by_name(receiver.trace(trace_id, 5))
    assert set(spans) == {"gateway_request", "llm_request", "queue", "prefill", "decode"}
    gw, server = spans["gateway_request"], spans["llm_request"]
    assert (gw["service"], gw["parent"]) == ("ferrylm-gateway", parent)
    assert (server["service"], server["parent"]) == ("ferrylm-serve", gw["span_id"])
    for phase in ("queue", "prefill", "decode"):
        assert spans[phase]["parent"] == server["span_id"] and spans[phase]["service"] == "ferrylm-serve"
        assert server["start"] <= spans[phase]["start"] <= spans[phase]["end"] <= server["end"]
    assert spans["queue"]["end"] <= spans["prefill"]["start"] and spans["prefill"]["end"] <= spans["decode"]["start"]
    assert gw["attrs"]["ferrylm.replica"] == replica.base_url and gw["attrs"]["http.response.status_code"] == 200
    assert gw["attrs"]["ferrylm.model_group"] == MODEL
    assert server["attrs"]["gen_ai.usage.completion_tokens"] == 4 and server["attrs"]["gen_ai.request.max_tokens"] == 4
    assert server["attrs"]["gen_ai.latency.time_to_first_token"] > 0
    assert spans["decode"]["attrs"]["ferrylm.detokenize_seconds"] >= 0
    assert gw["attrs"]["ferrylm.tenant"] == server["attrs"]["ferrylm.tenant"] == "anonymous"
    # per-tenant latency on both front doors (4 tokens: one TTFT, three gaps)
    for front in (gateway, replica):
        for name in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
            assert front.metrics()[f"ferrylm:tenant_{name}_seconds_count{{tenant=anonymous}}"] >= 1, (front, name)


def test_direct_request_trace_and_timings(traced):
    receiver, replica, _ = traced
    trace_id, parent = "5bf92f3577b34da6a3ce929d0e0e4737", "00f067aa0ba902b8"
    r = httpx.post(replica.url("/v1/completions"), headers=_traceparent(trace_id, parent), timeout=60,
                   json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 5, "temperature": 0,
                         "ignore_eos": True, "timings": True})
    assert r.status_code == 200
    timings = r.json()["timings"]
    assert timings["predicted_n"] == 4
    assert timings["prompt_n"] + timings["cache_n"] == r.json()["usage"]["prompt_tokens"]
    assert 0 < timings["ttft_ms"] <= timings["total_ms"] and timings["queue_ms"] >= 0
    assert timings["predicted_per_second"] > 0 and timings["prompt_ms"] > 0
    spans = _by_name(receiver.trace(trace_id, 4))
    root = spans["llm_request"]
    assert root["parent"] == parent and root["attrs"]["gen_ai.request.id"] == r.json()["id"]
    assert {s["parent"] for n, s in spans.items() if n != "llm_request"} == {spans["llm_request"]["span_id"]}
    metrics = replica.metrics()
    assert metrics["ferrylm:tokens_per_second_per_device"] > 0


def test_streamed_timings_come_in_the_last_chunk_before_done_and_only_when_asked(traced):
    _, replica, gateway = traced
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True,
            "temperature": 0}
    for server in (replica, gateway):  # the gateway passes the chunk on without the usage it did not ask for
        with httpx.stream("POST", server.url("/v1/chat/completions"), json=body | {"timings": True}, timeout=60) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and '"timings"' in events[-2]
        assert sum('"timings"' in e for e in events) == 1
        plain = httpx.post(server.url("/v1/chat/completions"), json=body | {"stream": False}, timeout=60).json()
        assert "timings" not in plain
