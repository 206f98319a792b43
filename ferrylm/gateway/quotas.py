"""Quotas: a tenant's daily token allowance (durable, in the state database) and its cap on
requests in flight (per gateway process).

The daily check counts what is already charged today plus what requests in flight here may still
use (their prompt + max_tokens holds), so concurrent requests cannot jointly overshoot from one
gateway; finish() turns the hold into the actual charge.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable

from sqlalchemy import Connection

from ferrylm.gateway.errors import too_many_requests
from ferrylm.gateway.store import Store


def utc_day(now: float) -> str:
    return dt.datetime.fromtimestamp(now, dt.UTC).strftime("%Y-%m-%d")


def seconds_to_utc_midnight(now: float) -> float:
    day = dt.datetime.fromtimestamp(now, dt.UTC).date()
    midnight = dt.datetime.combine(day + dt.timedelta(days=1), dt.time(), dt.UTC)
    return midnight.timestamp() - now


class ConcurrencyLimiter:
    """Counts sequences in flight per tenant (a request fanning out to k engine requests holds k)
    and refuses the request that would go over the tenant's cap."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active: dict[str, int] = {}

    def acquire(self, tenant: str, limit: int | None, count: int = 1) -> None:
        with self._lock:
            current = self._active.get(tenant, 0)
            if limit is not None and current + count > limit:
                what = "requests" if count == 1 else f"sequences (this request needs {count})"
                raise too_many_requests(
                    f"Too many concurrent {what} for tenant '{tenant}' (limit {limit}); retry when one finishes.",
                    "concurrency_limit_exceeded", "requests", 1.0)
            self._active[tenant] = current + count

    def release(self, tenant: str, count: int = 1) -> None:
        with self._lock:
            current = self._active.get(tenant, 0)
            if current < count:
                raise RuntimeError(f"release without acquire for tenant {tenant!r}")
            if current == count:
                del self._active[tenant]
            else:
                self._active[tenant] = current - count

    def active(self, tenant: str) -> int:
        with self._lock:
            return self._active.get(tenant, 0)

    def total(self) -> int:
        with self._lock:
            return sum(self._active.values())

    def check_invariants(self) -> None:
        with self._lock:
            if any(n <= 0 for n in self._active.values()):
                raise AssertionError(f"non-positive concurrency count: {self._active}")


class DailyQuota:
    """Daily token allowance per tenant: hold at admission, charge the actual use at the end."""

    def __init__(self, store: Store, clock: Callable[[], float] = time.time):
        self._store = store
        self._clock = clock
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}  # tenant → tokens held by requests in flight here

    def hold(self, tenant: str, limit: int | None, tokens: int) -> int:
        """Hold `tokens` against today's allowance; returns the amount held (0 if unlimited)."""
        if limit is None or tokens <= 0:
            return 0
        now = self._clock()
        used = self._store.usage(tenant, utc_day(now))
        with self._lock:
            held = self._held.get(tenant, 0)
            if used + held + tokens > limit:
                raise too_many_requests(
                    f"Daily token quota exceeded for tenant '{tenant}': {used} of {limit} tokens used today, "
                    f"{held} held by requests in flight, this request may need {tokens}.",
                    "insufficient_quota", "insufficient_quota", seconds_to_utc_midnight(now))
            self._held[tenant] = held + tokens
        return tokens

    def release(self, tenant: str, tokens: int) -> None:
        if not tokens:
            return
        with self._lock:
            left = self._held.get(tenant, 0) - tokens
            if left < 0:
                raise RuntimeError(f"released more daily quota than held for tenant {tenant!r}")
            if left:
                self._held[tenant] = left
            else:
                self._held.pop(tenant, None)

    def charge(self, conn: Connection, tenant: str, tokens: int) -> None:
        """Add actual use to today's total, inside the caller's transaction."""
        if tokens > 0:
            self._store.add_usage(conn, tenant, utc_day(self._clock()), tokens)

    def used_today(self, tenant: str) -> int:
        return self._store.usage(tenant, utc_day(self._clock()))

    def check_invariants(self) -> None:
        with self._lock:
            if any(n <= 0 for n in self._held.values()):
                raise AssertionError(f"non-positive daily hold: {self._held}")
