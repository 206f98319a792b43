"""What the gateway observes of one proxied request: its span (`gateway_request`, a child of the
client's `traceparent` and the parent of the replica's span, through the `traceparent` it injects
into the forwarded request) and the per-tenant latencies: TTFT and inter-token gaps from the
relayed stream (relay.py), e2e when the request settles."""

from __future__ import annotations

import time
from collections.abc import Mapping

from ferrylm.observability import tracing as otel
from ferrylm.router.metrics import RouterMetrics


class GatewayObservation:
    """Started once the request is admitted; `end` (at settlement) is idempotent."""

    def __init__(self, tracing: otel.Tracing | None, metrics: RouterMetrics, headers: Mapping[str, str],
                 group: str, tenant: str | None, request_id: str, start: float):
        self._tracing, self._metrics, self._group, self._tenant = tracing, metrics, group, tenant
        self._start = start
        self._last_token: float | None = None
        self._ended = False
        self._span = None
        if tracing is not None:
            attrs = {otel.GEN_AI_REQUEST_ID: request_id, "ferrylm.model_group": group}
            if tenant is not None:
                attrs["ferrylm.tenant"] = tenant
            self._span = tracing.start_server_span("gateway_request", headers, start, attrs)

    def inject(self, headers: dict[str, str]) -> None:
        """Make this request's span the parent of the replica's (its `traceparent` replaces the client's)."""
        if self._tracing is not None and self._span is not None:
            self._tracing.inject(self._span, headers)

    def replica(self, url: str) -> None:
        if self._span is not None:
            self._span.set_attribute("ferrylm.replica", url)

    def first_token(self, at: float) -> None:
        self._last_token = at
        if self._tenant is not None:
            self._metrics.tenants.ttft(self._group, self._tenant, at - self._start)
        if self._span is not None:
            self._span.set_attribute(otel.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN, at - self._start)

    def tokens(self, count: int, at: float | None = None) -> None:
        """`count` more tokens arrived in one event after the first: the gap since the last is shared."""
        at = time.monotonic() if at is None else at
        if self._last_token is not None and self._tenant is not None and count:
            self._metrics.tenants.itl(self._group, self._tenant, (at - self._last_token) / count, count)
        self._last_token = at

    def end(self, status: int, prompt_tokens: int | None = None, completion_tokens: int | None = None) -> None:
        if self._ended:
            return
        self._ended = True
        now = time.monotonic()
        if self._tenant is not None:
            self._metrics.tenants.e2e(self._group, self._tenant, now - self._start)
        if self._tracing is not None and self._span is not None:
            self._span.set_attribute("http.response.status_code", status)
            if prompt_tokens is not None:
                self._span.set_attribute(otel.GEN_AI_USAGE_PROMPT_TOKENS, prompt_tokens)
            if completion_tokens is not None:
                self._span.set_attribute(otel.GEN_AI_USAGE_COMPLETION_TOKENS, completion_tokens)
            self._span.set_attribute(otel.GEN_AI_LATENCY_E2E, now - self._start)
            self._tracing.end_span(self._span, now, error=status >= 500)
