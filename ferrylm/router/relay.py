"""Pass a committed replica's SSE stream to the client unbuffered, event by event, while keeping
the books: the replica's outstanding tokens shrink as tokens arrive, the first token sets TTFT,
the usage chunk (always requested upstream) is dropped unless the client asked for it. If the
replica fails mid-stream the client gets an explicit error event and [DONE], never silence."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable

import httpx

from ferrylm.http.settlement import Settlement
from ferrylm.router.dispatch import Dispatch, is_replica_fault
from ferrylm.router.metrics import RouterMetrics
from ferrylm.router.observation import GatewayObservation
from ferrylm.router.replica import Replica
from ferrylm.router.sse import DONE, Event, error_event

log = logging.getLogger("ferrylm.router")
# (status, prompt tokens or None, completion tokens, cached prompt tokens)
Settle = Callable[[int, int | None, int, int], Awaitable[None]]


def _error_status(error: dict) -> int:
    """The status an in-band error stands for (the client already has the 200)."""
    if error.get("type") == "invalid_request_error":
        return 400
    if error.get("type") == "overloaded_error":
        return 503
    return 503 if error.get("code") == "engine_dead" else 500


def _without_usage(event: Event) -> bytes | None:
    """The usage chunk the client did not ask for: dropped, unless it also carries the `timings`
    the client did ask for (then it goes on with `usage: null`)."""
    if not event.data or event.data.get("timings") is None:
        return None
    return f"data: {json.dumps(event.data | {'usage': None})}\n\n".encode()


class StreamRelay:
    """An async iterator of bytes for SSEResponse; closing it (client gone) closes the upstream
    connection, which makes the replica abort the request and free its KV blocks. A class, not an
    async generator, so that closing it settles even if it was never started."""

    def __init__(self, d: Dispatch, wants_usage: bool, settle: Settle, metrics: RouterMetrics,
                 on_failure: Callable[[Replica], None], on_done: Callable[["StreamRelay"], None] = lambda _: None,
                 observation: GatewayObservation | None = None, anthropic: bool = False):
        self._anthropic = anthropic  # a Messages stream: its own error event, and no [DONE]
        self._d, self._wants_usage, self._settle_cb, self._on_done = d, wants_usage, settle, on_done
        self._observation = observation  # per-tenant TTFT / ITL, the gateway's span
        self._aborted = False
        self._metrics, self._on_failure = metrics, on_failure
        self._faulted = False  # this stream's replica fault is counted (once) toward its breaker
        # Events read before commit: only the last can be a token (the first), and only if one came.
        self._pending = [(e, d.first_token_at is not None and i == len(d.head) - 1) for i, e in enumerate(d.head)]
        self._abort_task: asyncio.Task | None = None
        self._clean_end = False  # [DONE] seen: the rest of the body is read so the connection is reused
        self._completion = 0
        self._usage: dict | None = None
        self._status = 200
        self._first_seen = False
        self._head_token_pending = d.first_token_at is not None  # the head's token event, not yet relayed
        self._finished = False  # [DONE] passed (or an error event and [DONE] sent)
        self._tail: list[bytes] = []
        self._settlement: Settlement[[]] = Settlement(self._finish)
        if d.first_token_at is not None:
            self._on_first_token(d.first_token_at)

    def __aiter__(self) -> "StreamRelay":
        return self

    async def __anext__(self) -> bytes:
        while True:
            if self._tail:
                return self._tail.pop(0)
            if self._finished:
                await self._settlement.settle(self._status)
                raise StopAsyncIteration
            item = await self._next_event()
            if item is None:
                continue
            out = self._account(*item)
            if out is not None:
                return out

    async def _next_event(self) -> tuple[Event, bool] | None:
        """The next event and whether it carries generated tokens, or None when the stream broke."""
        if self._pending:
            return self._pending.pop(0)
        assert self._d.rest is not None  # a 200 stream always has its rest
        try:
            event = await self._d.rest.__anext__()
            return event, self._d.is_token(event)
        except StopAsyncIteration:
            reason = "closed the stream without [DONE]"
        except httpx.HTTPError as e:
            reason = f"failed mid-stream ({type(e).__name__})"
        if self._aborted:
            self._end_with_error("The gateway is shutting down; the response is incomplete.", "draining", 503)
        else:
            self._fail(reason)
        return None

    def abort(self) -> None:
        """Drain deadline passed: cut the upstream stream; the client gets an error event and [DONE]."""
        self._aborted = True
        self._abort_task = asyncio.ensure_future(self._d.response.aclose())

    def _fail(self, reason: str) -> None:
        log.warning("replica stream broke", extra={"replica": self._d.replica.url, "reason": reason})
        self._replica_fault()
        self._metrics.stream_errors.labels(self._d.group.name).inc()
        self._end_with_error(f"The model replica {reason}; the response is incomplete.", "upstream_error", 502)

    def _replica_fault(self) -> None:
        if not self._faulted:
            self._faulted = True
            self._on_failure(self._d.replica)

    def _end_with_error(self, message: str, code: str, status: int) -> None:
        self._status = status
        self._tail = [error_event(message, code, anthropic=True)] if self._anthropic else [error_event(message, code),
                                                                                            DONE]
        self._finished = True

    def _on_first_token(self, at: float) -> None:
        self._first_seen = True
        ttft = at - self._d.started
        self._d.replica.observe_ttft(ttft)
        self._metrics.ttft.labels(self._d.group.name).observe(ttft)
        self._d.ticket.first_token()
        if self._observation is not None:
            self._observation.first_token(at)

    def _account(self, event: Event, is_token: bool) -> bytes | None:
        if event.done:
            self._finished = self._clean_end = True
            return event.raw
        if is_token:
            if not self._first_seen:
                self._on_first_token(time.monotonic())
            elif self._head_token_pending:  # its time is the first token's, taken when it was read
                self._head_token_pending = False
            elif self._observation is not None:
                self._observation.tokens(event.tokens)
            self._completion += event.tokens
            self._d.ticket.generated(event.tokens)
        if event.error:
            self._status = _error_status(event.error)
            if is_replica_fault(None, event.error):  # the engine died: the replica's fault, as a broken stream is
                self._replica_fault()
        if event.usage is not None:
            self._usage = event.usage
            if not self._wants_usage:
                return _without_usage(event)
        return event.raw

    async def aclose(self) -> None:
        await self._settlement.settle(200 if self._finished and self._status == 200 else 499 if not self._finished
                           else self._status)

    async def _finish(self, status: int) -> None:
        """Once: leave the drain's set, close the upstream response (reused after a clean end),
        count the request and settle it with the usage the replica reported."""
        self._on_done(self)
        usage = self._usage or {}
        try:
            await self._d.aclose(finished=self._clean_end)
        finally:
            self._metrics.requests.labels(self._d.group.name, str(status)).inc()
            await self._settle_cb(status, usage.get("prompt_tokens"), usage.get("completion_tokens", self._completion),
                                  usage.get("cached_tokens", 0))
