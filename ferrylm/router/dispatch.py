"""Send a request to a replica of a model group, retrying elsewhere until the first token.

A try fails over (to another replica, then to the fallback groups) on a connect error, a 5xx,
a broken connection, or an in-band engine error before any token; every retry spends from the
fleet-wide RetryBudget and waits a doubling backoff, and each such replica fault counts toward
the replica's circuit breaker. A 4xx (or an in-band `invalid_request_error`) is the request's
fault, not the replica's: it is the answer, passed to the client as it came, never retried and
never counted (a half-open probe answered so is released undecided), so a client sending bad
requests cannot eject the fleet. Once a token has been read the replica is committed: later
failures end the stream with an error event (relay.py), never a retry."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

from ferrylm.http.errors import APIError
from ferrylm.router.config import RouterConfig
from ferrylm.router.disaggregation import PrefillTransfer
from ferrylm.router.metrics import RouterMetrics
from ferrylm.router.policies import RouteContext
from ferrylm.router.registry import ModelGroup, ReplicaRegistry
from ferrylm.router.replica import Replica, Ticket
from ferrylm.router.retry_budget import RetryBudget
from ferrylm.router.sse import Event, events

log = logging.getLogger("ferrylm.router")


REPLICA_FAULT_STATUSES = frozenset({502, 503, 504})  # the replica cannot serve: anything else is about the request


def is_replica_fault(status: int | None, error: dict | None = None) -> bool:
    """What the circuit breaker counts: no answer at all (status None: connect error, timeout,
    broken stream), 502/503/504, or an engine that died. A 500 or another in-band server error is
    what one request's content made the replica do: counting it would let one tenant repeating
    such a request eject a healthy replica for everyone."""
    if error is not None:
        return error.get("code") == "engine_dead"
    return status is None or status in REPLICA_FAULT_STATUSES


class UpstreamFailure(Exception):
    """A try that may be retried on another replica (nothing has reached the client)."""

    def __init__(self, replica: Replica, reason: str, status: int | None = None, detail: str = "",
                 replica_fault: bool = True):
        super().__init__(f"{replica.url}: {reason} {status or ''} {detail}".strip())
        self.replica, self.reason, self.status = replica, reason, status
        self.replica_fault = replica_fault  # counts toward the breaker (is_replica_fault)


@dataclass
class Dispatch:
    """A replica committed to a request: its response, and for streams the events read so far."""

    group: ModelGroup
    replica: Replica
    ticket: Ticket
    response: httpx.Response
    started: float
    attempts: int
    head: list[Event] = field(default_factory=list)
    rest: AsyncIterator[Event] | None = None
    first_token_at: float | None = None
    echo_left: int = 0  # completions with echo: text chunks of the echoed prompt still to come
    in_band_client_error: bool = False  # the stream's first event was an invalid_request_error

    @property
    def client_error(self) -> bool:
        """The replica refused the request itself (it is healthy; another would refuse it too)."""
        return is_client_error(self.response.status_code) or self.in_band_client_error

    def is_token(self, event: Event) -> bool:
        """Generated text, not the echoed prompt (which a replica sends before any prefill)."""
        if not event.tokens:
            return False
        if self.echo_left:
            self.echo_left = max(0, self.echo_left - event.tokens)
            return False
        return True

    async def aclose(self, finished: bool = False) -> None:
        """Close the upstream response (after reading its end when the stream finished, so the
        connection goes back to the pool) and release the ticket, whatever happens."""
        try:
            if finished and self.rest is not None:
                async with asyncio.timeout(1.0):
                    async for _ in self.rest:
                        pass
        except (TimeoutError, httpx.HTTPError):
            pass
        finally:
            try:
                await self.response.aclose()
            finally:
                self.ticket.close()


def is_client_error(status: int) -> bool:
    """4xx: the request's fault (bad parameters, auth, too large, rate limited), not the replica's."""
    return 400 <= status < 500


def _blames_request(error: dict) -> bool:
    """An in-band error event the replica raised about the request, not about itself."""
    return error.get("type") == "invalid_request_error"


def no_upstream(group: ModelGroup, failure: UpstreamFailure | None) -> APIError:
    if failure is None:
        return APIError(503, f"No healthy replica serves `{group.name}` right now; retry shortly.",
                        code="no_healthy_upstream")
    return APIError(502, f"Every replica tried for `{group.name}` failed before answering ({failure}).",
                    code="upstream_error", type_="server_error")


PREFILL_TIMEOUT_S = 120.0  # a disaggregated prefill and its KV transfer (past it the decode replica recomputes)


class Dispatcher:
    def __init__(self, registry: ReplicaRegistry, config: RouterConfig, client: httpx.AsyncClient,
                 metrics: RouterMetrics):
        self.registry, self.config, self.client, self.metrics = registry, config, client, metrics
        self.budget = RetryBudget(config.retry_budget_ratio, config.retry_budget_min)
        self.prefill = PrefillTransfer(client, PREFILL_TIMEOUT_S, config.connect_timeout_s, config.kv_transfer_key)

    async def dispatch(self, group: ModelGroup, path: str, body: dict, headers: dict[str, str],
                       ctx: RouteContext, stream: bool) -> Dispatch:
        """Commit a replica to this request (or raise APIError 502/503)."""
        self.budget.deposit()
        tried: set[str] = set()
        failure: UpstreamFailure | None = None
        attempts = 0
        for g in self.registry.fallback_chain(group):
            if g is not group and g.available(adapter=ctx.adapter):
                self.metrics.fallbacks.labels(group.name, g.name).inc()
            while attempts < self.config.max_attempts:
                now = time.monotonic()
                candidates = g.available(now, frozenset(tried), ctx.adapter)
                if not candidates:
                    break
                choice = g.policy.choose(candidates, ctx)
                breaker = choice.replica.breaker
                if not breaker.allow(now):  # its half-open probe is already out
                    tried.add(choice.replica.url)
                    continue
                if attempts and not self.budget.try_spend():
                    breaker.release_probe()
                    self.metrics.retries_denied.labels(g.name).inc()
                    raise no_upstream(group, failure)
                attempts += 1
                try:
                    result = await self._try(g, choice, path, body, headers, ctx, stream, attempts, failure)
                except UpstreamFailure as f:
                    failure = f
                    tried.add(f.replica.url)
                    log.warning("upstream try failed", extra={"replica": f.replica.url, "reason": f.reason,
                                                              "status": f.status, "attempt": attempts})
                    if f.replica_fault:
                        self.record_failure(f.replica)
                    else:
                        breaker.release_probe()
                    continue
                except BaseException:  # cancelled (client gone) or a bug: the replica is not to blame
                    breaker.release_probe()
                    raise
                if result.client_error:  # an answer, but it says nothing about the replica's health
                    breaker.release_probe()
                else:
                    breaker.record_success()
                    g.policy.record(ctx, choice.replica)
                return result
        raise no_upstream(group, failure)

    async def _try(self, g: ModelGroup, choice, path: str, body: dict, headers: dict[str, str], ctx: RouteContext,
                   stream: bool, attempts: int, failure: UpstreamFailure | None) -> Dispatch:
        if attempts > 1:
            self.metrics.retries.labels(g.name, failure.reason if failure else "none").inc()
            await asyncio.sleep(self.config.retry_backoff_s * 2 ** (attempts - 2))
        self.metrics.decisions.labels(g.name, g.policy.name, choice.reason).inc()
        return await self._attempt(g, choice.replica, path, body, headers, ctx, stream, attempts)

    def record_failure(self, replica: Replica) -> None:
        if replica.breaker.record_failure(time.monotonic()):
            self.metrics.ejections.labels(replica.group, replica.url).inc()
            log.warning("replica ejected", extra={"replica": replica.url})

    async def _attempt(self, group: ModelGroup, replica: Replica, path: str, body: dict, headers: dict[str, str],
                       ctx: RouteContext, stream: bool, attempts: int) -> Dispatch:
        # the replica's own name for the model; a LoRA adapter keeps its name (the replica serves it by it)
        payload = dict(body, model=ctx.adapter or replica.served_model or group.name)
        if group.config.prefill_upstreams and ctx.prompt_token_ids:  # the disaggregated policy
            moved = await self.prefill.run(group.name, group.config.prefill_upstreams, payload["model"], replica.url,
                                           ctx.prompt_token_ids, headers, ctx.cache_salt)
            self.metrics.kv_transfers.labels(group.name, "failed" if moved is None else "ok").inc()
        ticket = replica.begin(ctx.prompt_tokens, ctx.expected_output)
        started = time.monotonic()
        response: httpx.Response | None = None
        # A non-streamed answer comes whole at the end: a long generation is not a hung replica, so
        # only the connect timeout applies (the client's own timeout bounds the wait).
        timeout = httpx.USE_CLIENT_DEFAULT if stream else httpx.Timeout(None, connect=self.config.connect_timeout_s)
        try:
            request = self.client.build_request("POST", replica.url + path, json=payload, headers=headers,
                                                timeout=timeout)
            try:
                response = await self.client.send(request, stream=True)
            except httpx.TransportError as e:
                raise UpstreamFailure(replica, type(e).__name__, detail=str(e)) from None
            if response.status_code >= 500:
                raise UpstreamFailure(replica, "status", response.status_code,
                                      replica_fault=is_replica_fault(response.status_code))
            result = Dispatch(group, replica, ticket, response, started, attempts, echo_left=ctx.echo_chunks)
            if stream and response.status_code == 200:
                await self._read_head(result)
            else:
                try:
                    await response.aread()
                except httpx.TransportError as e:
                    raise UpstreamFailure(replica, type(e).__name__, detail=str(e)) from None
            return result
        except BaseException:
            if response is not None:
                await response.aclose()
            ticket.close()
            raise

    async def _read_head(self, d: Dispatch) -> None:
        """Read events up to the first token (or the end): until then a failure can still retry."""
        d.rest = events(d.response).__aiter__()
        try:
            while True:
                event = await d.rest.__anext__()
                if event.error and _blames_request(event.error):  # the answer, as from any replica
                    d.head.append(event)
                    d.in_band_client_error = True
                    return
                if event.error:  # nothing has reached the client yet: another replica may do better
                    raise UpstreamFailure(d.replica, "stream_error", detail=str(event.error.get("message")),
                                          replica_fault=is_replica_fault(None, event.error))
                d.head.append(event)
                if d.is_token(event):
                    d.first_token_at = time.monotonic()
                    return
                if event.done or event.finished:
                    return
        except StopAsyncIteration:  # ended with no token, no finish and no [DONE]: not an answer
            raise UpstreamFailure(d.replica, "stream_ended") from None
        except httpx.TransportError as e:
            raise UpstreamFailure(d.replica, type(e).__name__, detail=str(e)) from None
