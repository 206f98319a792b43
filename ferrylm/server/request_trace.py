"""The server's span of one request (`llm_request`, vLLM's name), a child of the client's W3C
`traceparent`, ended once the response ended however it ended; the engine's `queue`, `prefill` and
`decode` spans are emitted under it then, from the times the engine stamped (never per step)."""

from __future__ import annotations

from collections.abc import Mapping

from ferrylm.observability import tracing as otel
from ferrylm.observability.request_timeline import RequestTimeline
from ferrylm.outputs import Usage
from ferrylm.sampling_params import SamplingParams
from ferrylm.server.fanout import Fanout


class RequestTrace:
    """Started when the request is admitted to the engine; `end` is idempotent."""

    def __init__(self, tracing: otel.Tracing, headers: Mapping[str, str], request_id: str, model: str,
                 start: float, params: SamplingParams, tenant: str | None):
        self._tracing = tracing
        self._start = start
        attrs = {otel.GEN_AI_REQUEST_ID: request_id, otel.GEN_AI_RESPONSE_MODEL: model,
                 otel.GEN_AI_REQUEST_MAX_TOKENS: params.max_tokens or 0,
                 otel.GEN_AI_REQUEST_TEMPERATURE: params.temperature, otel.GEN_AI_REQUEST_TOP_P: params.top_p,
                 otel.GEN_AI_REQUEST_N: params.n}
        if tenant is not None:
            attrs["ferrylm.tenant"] = tenant
        self._span = tracing.start_server_span("llm_request", headers, start, attrs)
        self._ended = False

    def end(self, status: int, fanout: Fanout | None) -> None:
        if self._ended:
            return
        self._ended = True
        span = self._span
        span.set_attribute("http.response.status_code", status)
        if fanout is not None:
            finals = fanout.finals()
            span.set_attribute(otel.GEN_AI_USAGE_PROMPT_TOKENS,
                               Usage.of([len(p) for p in fanout.prompts], 0).prompt_tokens)
            span.set_attribute(otel.GEN_AI_USAGE_NUM_SEQUENCES, fanout.num_choices)
            timeline = RequestTimeline.of(self._start, finals)
            if timeline is not None:
                span.set_attributes(otel.timeline_attributes(timeline))
                otel.emit_engine_spans(self._tracing, span, timeline)
        self._tracing.end_span(span, error=status >= 500)

