"""Gateway: the policy seam in front of the engine. The server calls `admit` before it queues a
request and `finish` once the request has ended (however it ended):

    admission = await gateway.admit(request.headers, client_addr, model, prompt_tokens, max_tokens, stats)
    ... run the request at admission.priority, send admission.response_headers ...
    await gateway.finish(admission, status, prompt_tokens, completion_tokens, latency)

`admit` runs auth → model permission → admission control → concurrency → daily quota → rate
limits, and raises http.errors.APIError (its `response()` renders it) or returns an
Admission holding everything `finish` must give back. Blocking work (database, Redis) runs in a
worker thread so the event loop never waits on it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ferrylm.gateway.admission import AdmissionController, DrainRateTracker, shed_error
from ferrylm.gateway.audit import AuditLog, AuditRecord
from ferrylm.gateway.auth import Authenticator, Principal, check_model
from ferrylm.gateway.config import AdmissionConfig, GatewayConfig, JWTConfig
from ferrylm.gateway.errors import AuthError, too_many_requests
from ferrylm.gateway.quotas import ConcurrencyLimiter, DailyQuota
from ferrylm.gateway.rate_limit import (
    BucketHold,
    BucketStorage,
    MemoryBucketStorage,
    RateLimiter,
    RateLimitResult,
    RateScope,
)
from ferrylm.gateway.store import Store
from ferrylm.http.errors import APIError, anthropic_key_as_bearer
from ferrylm.load_report import LoadReport

__all__ = ["Admission", "AdmissionConfig", "Gateway", "GatewayConfig", "JWTConfig"]

log = logging.getLogger("ferrylm.gateway")


@dataclass(frozen=True)
class Admission:
    """An admitted request: who, at which priority, and what it holds until `finish`."""

    admission_id: str
    request_id: str
    principal: Principal
    model: str
    priority: int  # pass to the engine (lower runs first)
    client_addr: str | None
    started_at: float
    prompt_tokens: int
    max_tokens: int
    daily_hold: int
    reservation: BucketHold | None
    rate_limit: RateLimitResult | None
    projected_wait_s: float | None
    num_sequences: int = 1  # engine requests (prompts × n), each held against the concurrency cap

    @property
    def response_headers(self) -> dict[str, str]:
        """x-ratelimit-* headers to copy onto the response (empty when no limits apply)."""
        return self.rate_limit.headers() if self.rate_limit else {}


def _header(headers: Mapping[str, str] | None, name: str) -> str | None:
    """Case-insensitive lookup that works for plain dicts and Starlette Headers alike."""
    if not headers:
        return None
    value = headers.get(name)
    if value is None:
        value = next((v for k, v in headers.items() if isinstance(k, str) and k.lower() == name), None)
    return value if isinstance(value, str) else None


def _scopes(principal: Principal) -> list[RateScope]:
    scopes = [RateScope(f"tenant:{principal.tenant}", principal.rpm, principal.tpm)]
    if principal.key_id and (principal.key_rpm or principal.key_tpm):
        scopes.append(RateScope(f"key:{principal.key_id}", principal.key_rpm, principal.key_tpm))
    return scopes


def _rate_limited(result: RateLimitResult, principal: Principal, tokens: int) -> APIError:
    headers = result.headers()
    if result.too_large and result.tokens is not None:
        return APIError(429, f"Request too large for tenant '{principal.tenant}': it may need {tokens} tokens "
                             f"(prompt + max_tokens) but the limit is {result.tokens.limit} tokens per minute. "
                             "Reduce max_tokens or the prompt.", code="rate_limit_exceeded", type_="tokens",
                        headers=headers)
    kind = result.limited_by or "requests"
    return too_many_requests(f"Rate limit reached for tenant '{principal.tenant}' on {kind} per minute. "
                             f"Please try again in {result.retry_after_s:.2f}s.", "rate_limit_exceeded", kind,
                             result.retry_after_s, headers)


def _make_storage(config: GatewayConfig, clock: Callable[[], float] | None) -> BucketStorage:
    if config.redis_url:
        from ferrylm.gateway.rate_limit_redis import RedisBucketStorage

        return RedisBucketStorage.from_url(config.redis_url, config.redis_key_prefix, clock)
    return MemoryBucketStorage(clock or time.monotonic)


class Gateway:
    """Auth, limits, quotas, admission and audit for one server process. `clock` (epoch seconds)
    is injectable for tests; `store` and `bucket_storage` default to those the config names (a
    store passed in stays the caller's to close)."""

    def __init__(self, config: GatewayConfig, *, store: Store | None = None,
                 bucket_storage: BucketStorage | None = None, clock: Callable[[], float] | None = None):
        self.config = config
        self._clock = clock or time.time
        self._owns_store = store is None
        self.store = store or Store(config.state_db, self._clock)
        self.authenticator = Authenticator(self.store, config.jwt, self._clock)
        self.limiter = RateLimiter(bucket_storage or _make_storage(config, clock))
        self.limiter_failures = 0  # limit-store errors seen (each answered per rate_limit_failure_mode)
        self.concurrency = ConcurrencyLimiter()
        self.daily = DailyQuota(self.store, self._clock)
        self.admission = AdmissionController(config.admission)
        self.drain = DrainRateTracker(default_completion_tokens=config.admission.default_completion_tokens)
        self.audit = AuditLog(self.store, config.audit_prompts)
        self._lock = threading.Lock()
        self._open: dict[str, Admission] = {}
        # Its own threads: a slow database or Redis must not starve the server's other thread work.
        self._executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="ferrylm-gateway")
        self._anonymous = Principal(config.anonymous_tenant, None, config.admission.default_tier, "anonymous")

    # the async seam

    async def authenticate(self, request_headers: Mapping[str, str] | None) -> Principal:
        """Who is calling (AuthError 401 if auth is required and they cannot say). Servers call it
        before reading the body, so an unauthenticated caller learns nothing about validation."""
        authorization = _header(request_headers, "authorization") or (
            anthropic_key_as_bearer({"x-api-key": _header(request_headers, "x-api-key")}))
        call = functools.partial(self._identify, authorization)
        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    async def charge_request(self, principal: Principal, client_addr: str | None = None,
                             request_id: str | None = None) -> RateLimitResult:
        """Take one request from the caller's requests/min buckets before the body is read or
        tokenized (429 at once when empty), so expensive bad requests count as requests too. Pass
        the result to `admit(request_charge=...)`, which then reserves tokens only."""
        call = functools.partial(self.charge_request_sync, principal, client_addr, request_id)
        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    def charge_request_sync(self, principal: Principal, client_addr: str | None = None,
                            request_id: str | None = None) -> RateLimitResult:
        started = self._clock()
        scopes = [scope._replace(tpm=None) for scope in _scopes(principal)]
        try:
            return self._take(principal, scopes, 0, True)
        except APIError as err:
            if self.config.audit_rejections:
                self._audit(AuditRecord(started, request_id or f"req-{uuid.uuid4().hex}", principal.tenant,
                                        principal.key_id, None, 0, 0, err.status, self._clock() - started,
                                        client_addr, err.code))
            raise

    async def identify(self, request_headers: Mapping[str, str] | None, client_addr: str | None = None,
                       request_id: str | None = None) -> tuple[Principal, RateLimitResult]:
        """`authenticate`, then `charge_request`: what both front doors ask before reading a body."""
        principal = await self.authenticate(request_headers)
        return principal, await self.charge_request(principal, client_addr, request_id)

    def tier_priority(self, admission: Admission) -> int | None:
        """With auth on, the tenant's tier decides the priority (clients cannot jump the queue);
        None when the client's own priority stands."""
        return admission.priority if self.config.require_auth else None

    async def admit(self, request_headers: Mapping[str, str] | None, client_addr: str | None, model: str,
                    prompt_tokens: int, max_tokens: int, stats_snapshot: LoadReport | None, *,
                    request_id: str | None = None, engine_healthy: bool = True,
                    principal: Principal | None = None, num_sequences: int = 1,
                    request_charge: RateLimitResult | None = None) -> Admission:
        """Admit a request or raise APIError. If the caller is cancelled meanwhile, an
        admission that still went through is finished (released) in the background. `principal`:
        the result of `authenticate`, if the caller already ran it; `num_sequences`: the engine
        requests it fans out to (prompts × n), each counted against the tenant's concurrency;
        `request_charge`: the result of `charge_request`, if the caller already ran it."""
        call = functools.partial(self.admit_sync, request_headers, client_addr, model, prompt_tokens, max_tokens,
                                 stats_snapshot, request_id=request_id, engine_healthy=engine_healthy,
                                 principal=principal, num_sequences=num_sequences, request_charge=request_charge)
        future = asyncio.get_running_loop().run_in_executor(self._executor, call)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(self._release_abandoned)
            raise

    async def finish(self, admission: Admission, status: int, prompt_tokens: int, completion_tokens: int,
                     latency: float | None = None, *, prompt: str | None = None, error_code: str | None = None,
                     cached_tokens: int = 0) -> None:
        """Settle limits, release concurrency, charge the daily quota, write the audit record.
        Idempotent; completes even if the caller is cancelled; never raises."""
        call = functools.partial(self.finish_sync, admission, status, prompt_tokens, completion_tokens, latency,
                                 prompt=prompt, error_code=error_code, cached_tokens=cached_tokens)
        try:
            future = asyncio.get_running_loop().run_in_executor(self._executor, call)
        except RuntimeError:  # closed during shutdown: release inline rather than leak
            call()
            return
        await asyncio.shield(future)

    def _release_abandoned(self, future: asyncio.Future) -> None:
        """An admit whose caller was cancelled: finish it as 499 if it went through."""
        if future.cancelled() or future.exception() is not None:
            return
        admission = future.result()
        release = functools.partial(self.finish_sync, admission, 499, admission.prompt_tokens, 0,
                                    error_code="client_disconnected")
        asyncio.get_running_loop().run_in_executor(self._executor, release)

    # the synchronous core (also usable from a worker thread directly)

    def admit_sync(self, request_headers: Mapping[str, str] | None, client_addr: str | None, model: str,
                   prompt_tokens: int, max_tokens: int, stats_snapshot: LoadReport | None, *,
                   request_id: str | None = None, engine_healthy: bool = True,
                   principal: Principal | None = None, num_sequences: int = 1,
                   request_charge: RateLimitResult | None = None) -> Admission:
        started = self._clock()
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        principal = principal or self._identify(_header(request_headers, "authorization"))
        try:
            return self._admit_principal(principal, client_addr, model, prompt_tokens, max_tokens,
                                         stats_snapshot, request_id, engine_healthy, started, num_sequences,
                                         request_charge)
        except APIError as err:
            if self.config.audit_rejections:
                self._audit(AuditRecord(started, request_id, principal.tenant, principal.key_id, model, prompt_tokens,
                                        0, err.status, self._clock() - started, client_addr, err.code))
            raise

    def _identify(self, authorization: str | None) -> Principal:
        if self.config.require_auth:
            return self.authenticator.authenticate(authorization)
        if authorization:  # an open server still honours real credentials (their tenant, their limits)
            try:
                return self.authenticator.authenticate(authorization)
            except AuthError:
                pass
        return self._anonymous

    def _load(self, stats_snapshot: LoadReport | None, engine_healthy: bool, now: float) -> LoadReport | None:
        if stats_snapshot is None:
            return None if engine_healthy else LoadReport.empty(healthy=False)
        load = stats_snapshot if engine_healthy else dataclasses.replace(stats_snapshot, healthy=False)
        self.drain.observe_snapshot(load, now)
        return load

    def _admit_principal(self, principal: Principal, client_addr: str | None, model: str, prompt_tokens: int,
                         max_tokens: int, stats_snapshot: LoadReport | None, request_id: str, engine_healthy: bool,
                         started: float, num_sequences: int = 1,
                         request_charge: RateLimitResult | None = None) -> Admission:
        check_model(principal, model)
        load = self._load(stats_snapshot, engine_healthy, started)
        decision = self.admission.decide(load, principal.tier, self.drain.rate, self.drain.mean_completion_tokens,
                                         self.drain.output_fraction, self.drain.decode_rate)
        if not decision.admitted:
            raise shed_error(decision, principal.tier)
        tokens = max(0, prompt_tokens) + max(0, max_tokens)
        self.concurrency.acquire(principal.tenant, principal.max_concurrency, num_sequences)
        held = 0
        try:
            held = self.daily.hold(principal.tenant, principal.daily_tokens, tokens)
            result = self._take(principal, _scopes(principal), tokens, request_charge is None)
        except BaseException:
            self.daily.release(principal.tenant, held)
            self.concurrency.release(principal.tenant, num_sequences)
            raise
        if request_charge is not None:  # its requests/min view is the one to report
            result = dataclasses.replace(result, requests=request_charge.requests)
        admission = Admission(uuid.uuid4().hex, request_id, principal, model, decision.priority, client_addr, started,
                              prompt_tokens, max_tokens, held, result.reservation, result, decision.projected_wait_s,
                              num_sequences)
        with self._lock:
            self._open[admission.admission_id] = admission
        return admission

    def _take(self, principal: Principal, scopes: list[RateScope], tokens: int, requests: bool) -> RateLimitResult:
        try:
            result = self.limiter.reserve(scopes, tokens, requests)
        except Exception:
            self.limiter_failures += 1
            if self.config.rate_limit_failure_mode == "open":
                log.warning("rate limiter storage failed; admitting unmetered (fail-open)", exc_info=True)
                return RateLimitResult(True)  # no reservation: nothing to settle
            log.exception("rate limiter storage failed")
            raise APIError(503, "Rate limiting is unavailable; please retry shortly.", code="rate_limiter_unavailable",
                           type_="server_error", headers={"Retry-After": "1"}) from None
        if not result.allowed:
            raise _rate_limited(result, principal, tokens)
        return result

    def finish_sync(self, admission: Admission, status: int, prompt_tokens: int, completion_tokens: int,
                    latency: float | None = None, *, prompt: str | None = None, error_code: str | None = None,
                    cached_tokens: int = 0) -> None:
        with self._lock:
            if self._open.pop(admission.admission_id, None) is None:
                return  # finished already
            others = bool(self._open)
        prompt_tokens, completion_tokens = max(0, prompt_tokens), max(0, completion_tokens)
        cached_tokens = min(max(0, cached_tokens), prompt_tokens)
        tenant, now = admission.principal.tenant, self._clock()
        used = self.config.billed_tokens(prompt_tokens, completion_tokens, cached_tokens)
        self.concurrency.release(tenant, admission.num_sequences)
        self.daily.release(tenant, admission.daily_hold)
        self.drain.observe_completion(used, completion_tokens, others, now,
                                      admission.max_tokens if status == 200 else None)
        if admission.reservation is not None:
            try:
                self.limiter.settle(admission.reservation, used)
            except Exception:
                log.exception("rate limiter settle failed", extra={"request_id": admission.request_id})
        p = admission.principal
        record = AuditRecord(admission.started_at, admission.request_id, tenant, p.key_id, admission.model,
                             prompt_tokens, completion_tokens, status,
                             latency if latency is not None else now - admission.started_at,
                             admission.client_addr, error_code, prompt, cached_tokens)
        self._audit(record, charge=used)

    def _audit(self, record: AuditRecord, charge: int = 0) -> None:
        """Audit row and daily usage in one transaction; a failure is logged, never raised."""
        def write(conn) -> None:
            if charge and record.tenant is not None:
                self.daily.charge(conn, record.tenant, charge)
            self.audit.append(conn, record)

        try:
            self.store.run_in_transaction(write)
        except Exception:
            log.exception("audit write failed", extra={"request_id": record.request_id})

    # inspection

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._open)

    def check_invariants(self) -> None:
        """Open admissions match the concurrency counts; every part is internally consistent."""
        with self._lock:
            per_tenant: dict[str, int] = {}
            for a in self._open.values():
                per_tenant[a.principal.tenant] = per_tenant.get(a.principal.tenant, 0) + a.num_sequences
        for tenant, n in per_tenant.items():
            if self.concurrency.active(tenant) != n:
                raise AssertionError(f"tenant {tenant}: {n} open admissions, {self.concurrency.active(tenant)} counted")
        if self.concurrency.total() != sum(per_tenant.values()):
            raise AssertionError("concurrency counts tenants with no open admission")
        self.limiter.check_invariants()
        self.concurrency.check_invariants()
        self.daily.check_invariants()
        self.drain.check_invariants()

    def close(self) -> None:
        """Wait for admissions and finishes in progress, then close the connections."""
        self._executor.shutdown(wait=True)
        self.limiter.storage.close()
        if self._owns_store:
            self.store.close()
