"""OpenTelemetry traces over OTLP (--otlp-traces-endpoint, vLLM's flag), one TracerProvider per app.

Nothing here touches OpenTelemetry's global provider or propagator: each app builds its own
`Tracing` from its config and hands it down, and with tracing off there is no `Tracing` at all
(callers hold None and skip every call; OpenTelemetry is not even imported). The W3C
`traceparent` of an incoming request is the parent of the app's request span, and the gateway
injects its own span's `traceparent` into the request it forwards, so gateway → replica → engine
spans form one trace.

The engine never calls a tracer: it stamps monotonic times on each request, and the server emits
the `queue`, `prefill` and `decode` spans afterwards with explicit start and end times
(`emit_engine_spans`, from a RequestTimeline).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ferrylm.config import ConfigError
from ferrylm.observability.request_timeline import RequestTimeline

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

PROTOCOLS = ("grpc", "http/protobuf")
TRACE_HEADERS = ("traceparent", "tracestate")

# vLLM's span attribute names (vllm/tracing.py, after OpenTelemetry's gen_ai semantic conventions)
GEN_AI_REQUEST_ID = "gen_ai.request.id"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_N = "gen_ai.request.n"
GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
GEN_AI_USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"


@dataclass(frozen=True)
class TracingConfig:
    """Where spans go. `protocol` is OTEL_EXPORTER_OTLP_TRACES_PROTOCOL's (grpc by default, as vLLM);
    the exporter itself still reads the standard OTEL_EXPORTER_OTLP_TRACES_HEADERS / _INSECURE /
    _CERTIFICATE / _TIMEOUT variables."""

    otlp_traces_endpoint: str
    service_name: str = "ferrylm"
    protocol: str = "grpc"
    export_delay_ms: int = 1000  # BatchSpanProcessor schedule delay (spans are also flushed at shutdown)

    def __post_init__(self) -> None:
        if not self.otlp_traces_endpoint:
            raise ConfigError("--otlp-traces-endpoint must be a URL")
        if self.protocol not in PROTOCOLS:
            raise ConfigError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL must be one of {', '.join(PROTOCOLS)}, "
                              f"not {self.protocol!r}")
        if self.export_delay_ms < 1:
            raise ConfigError("the span export delay must be at least 1 ms")


def _otlp_exporter(config: TracingConfig) -> SpanExporter:
    try:
        if config.protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

            return Grpc(endpoint=config.otlp_traces_endpoint)
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

        return Http(endpoint=config.otlp_traces_endpoint)
    except ImportError as e:
        raise ConfigError(f"--otlp-traces-endpoint needs the OpenTelemetry packages: pip install 'ferrylm[otel]' "
                          f"({e})") from None


class Tracing:
    """One app's tracer on its own TracerProvider. `exporter` replaces the OTLP one (tests inject
    the SDK's InMemorySpanExporter; its spans are exported synchronously as they end)."""

    def __init__(self, config: TracingConfig | None, exporter: SpanExporter | None = None):
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        service = config.service_name if config is not None else "ferrylm"
        self.provider = TracerProvider(resource=Resource.create({"service.name": service}))
        if exporter is not None:
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        elif config is not None:
            self.provider.add_span_processor(
                BatchSpanProcessor(_otlp_exporter(config), schedule_delay_millis=config.export_delay_ms))
        self.tracer: Tracer = self.provider.get_tracer("ferrylm")
        self._propagator = TraceContextTextMapPropagator()
        # one monotonic → epoch offset for the app's life, so spans stamped from monotonic times keep their
        # order exactly (an offset taken per stamp jitters by nanoseconds)
        self._epoch_offset_ns = time.time_ns() - time.monotonic_ns()

    @classmethod
    def create(cls, config: TracingConfig | None, exporter: SpanExporter | None = None) -> Tracing | None:
        """None (tracing off, nothing imported) unless an endpoint or an exporter is given."""
        return None if config is None and exporter is None else cls(config, exporter)

    def parent(self, headers: Mapping[str, str]) -> Context:
        """The caller's trace context from its W3C `traceparent` / `tracestate` (empty without one)."""
        return self._propagator.extract({name: headers[name] for name in TRACE_HEADERS if name in headers})

    def inject(self, span: Span, headers: dict[str, str]) -> None:
        """Set `traceparent` (and `tracestate`) in `headers` to make `span` the next hop's parent."""
        from opentelemetry.trace import set_span_in_context

        for name in TRACE_HEADERS:
            headers.pop(name, None)
        self._propagator.inject(headers, context=set_span_in_context(span))

    def start_server_span(self, name: str, headers: Mapping[str, str], start: float,
                          attributes: Mapping[str, Any] | None = None) -> Span:
        """A SERVER span begun at monotonic time `start`, child of the caller's `traceparent`."""
        from opentelemetry.trace import SpanKind

        return self.tracer.start_span(name, context=self.parent(headers), kind=SpanKind.SERVER,
                                      attributes=dict(attributes or {}), start_time=self.wall_ns(start))

    def wall_ns(self, monotonic: float) -> int:
        """A time.monotonic() stamp as the epoch nanoseconds spans carry."""
        return self._epoch_offset_ns + int(monotonic * 1e9)

    def end_span(self, span: Span, at: float | None = None, error: bool = False) -> None:
        """End `span` at monotonic time `at` (now by default), with an ERROR status if `error`."""
        from opentelemetry.trace import Status, StatusCode

        if error:
            span.set_status(Status(StatusCode.ERROR))
        span.end(end_time=self.wall_ns(time.monotonic() if at is None else at))

    def shutdown(self) -> None:
        """Flush what is queued and stop the exporter."""
        self.provider.shutdown()


def timeline_attributes(t: RequestTimeline) -> dict[str, Any]:
    """vLLM's latency attributes of the request span, in seconds."""
    attrs: dict[str, Any] = {GEN_AI_USAGE_COMPLETION_TOKENS: t.completion_tokens}
    for name, value in ((GEN_AI_LATENCY_TIME_IN_QUEUE, t.queue_s), (GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN, t.ttft_s),
                        (GEN_AI_LATENCY_E2E, t.e2e_s)):
        if value is not None:
            attrs[name] = value
    if t.first_scheduled is not None and t.first_token is not None:
        attrs[GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] = t.first_token - t.first_scheduled
    if t.first_token is not None and t.finished is not None:
        attrs[GEN_AI_LATENCY_TIME_IN_MODEL_DECODE] = t.finished - t.first_token
    return attrs


def emit_engine_spans(tracing: Tracing, parent: Span, t: RequestTimeline) -> None:
    """The engine phases as child spans of `parent`, each with the times the engine stamped:
    queue (arrival → first scheduled), prefill (→ first token), decode (→ finish; the time spent
    detokenizing is its `ferrylm.detokenize_seconds`). A phase that never began is left out."""
    from opentelemetry.trace import set_span_in_context

    context = set_span_in_context(parent)
    phases: list[tuple[str, float | None, float | None, dict[str, float]]]  # (name, begin, end, attributes)
    phases = [("queue", t.arrival, t.first_scheduled, {}),
              ("prefill", t.first_scheduled, t.first_token,
               {"ferrylm.prefilled_tokens": t.prefilled_tokens, "ferrylm.cached_tokens": t.cached_tokens}),
              ("decode", t.first_token, t.finished,
               {GEN_AI_USAGE_COMPLETION_TOKENS: t.completion_tokens,
                "ferrylm.detokenize_seconds": round(t.detokenize_s, 6)})]
    for name, begin, end, attrs in phases:
        if begin is None or end is None:
            continue
        span = tracing.tracer.start_span(name, context=context, attributes=attrs, start_time=tracing.wall_ns(begin))
        span.end(end_time=tracing.wall_ns(end))
