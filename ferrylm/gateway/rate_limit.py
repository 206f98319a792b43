"""Token-aware rate limits: requests/min and tokens/min token buckets per tenant and per key.

At admission a request takes 1 from each request bucket and (prompt + max_tokens) from each token
bucket, all or nothing; `settle` gives back what it did not use once it ends. Buckets live in a
BucketStorage: in this process (MemoryBucketStorage) or shared by every gateway through Redis
(RedisBucketStorage in rate_limit_redis.py). A bucket never seen, or idle long enough, is full.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

_EPS = 1e-3  # tokens of float slack (epoch-second clocks): a refill landing on the amount fits


@dataclass(frozen=True)
class BucketSpec:
    """One bucket: holds up to `capacity`, refills at `rate` per second."""

    key: str
    capacity: float
    rate: float
    kind: str  # "requests" | "tokens"


class TakeResult(NamedTuple):
    allowed: bool
    levels: tuple[float, ...]  # after the take when allowed, else as they stand
    waits: tuple[float, ...]  # seconds until each bucket could cover its amount (0: it can now)


class BucketStorage(Protocol):
    """Where bucket levels live. Both operations are atomic over all the buckets given."""

    def take(self, specs: Sequence[BucketSpec], amounts: Sequence[float]) -> TakeResult: ...

    def give(self, specs: Sequence[BucketSpec], amounts: Sequence[float]) -> tuple[float, ...]: ...

    def check_invariants(self) -> None: ...

    def close(self) -> None: ...


class MemoryBucketStorage:
    """Buckets in a dict under a lock: exact for one gateway process, shared by none."""

    _PRUNE_EVERY = 1024

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float, float, float]] = {}  # key → level, ts, capacity, rate
        self._ops = 0

    def _level(self, spec: BucketSpec, now: float) -> float:
        entry = self._buckets.get(spec.key)
        if entry is None:
            return spec.capacity
        level, ts = entry[0], entry[1]
        return min(spec.capacity, level + max(0.0, now - ts) * spec.rate)

    def take(self, specs: Sequence[BucketSpec], amounts: Sequence[float]) -> TakeResult:
        with self._lock:
            now = self._clock()
            levels = [self._level(s, now) for s in specs]
            waits = tuple(0.0 if lvl + _EPS >= a else (a - lvl) / s.rate for s, a, lvl in zip(specs, amounts, levels))
            allowed = all(w == 0.0 for w in waits)
            if allowed:
                levels = [lvl - a for lvl, a in zip(levels, amounts)]
                for s, lvl in zip(specs, levels):
                    self._buckets[s.key] = (lvl, now, s.capacity, s.rate)
            self._maybe_prune(now)
            return TakeResult(allowed, tuple(levels), waits)

    def give(self, specs: Sequence[BucketSpec], amounts: Sequence[float]) -> tuple[float, ...]:
        """Add `amounts` back (negative: charge an overrun); a bucket never exceeds its capacity."""
        with self._lock:
            now = self._clock()
            levels = tuple(min(s.capacity, self._level(s, now) + a) for s, a in zip(specs, amounts))
            for s, lvl in zip(specs, levels):
                self._buckets[s.key] = (lvl, now, s.capacity, s.rate)
            return levels

    def _maybe_prune(self, now: float) -> None:
        """Forget buckets that have refilled completely: absent means full."""
        self._ops += 1
        if self._ops % self._PRUNE_EVERY:
            return
        full = [k for k, (lvl, ts, cap, rate) in self._buckets.items() if lvl + (now - ts) * rate >= cap]
        for key in full:
            del self._buckets[key]

    def check_invariants(self) -> None:
        with self._lock:
            for key, (level, ts, capacity, rate) in self._buckets.items():
                if not (math.isfinite(level) and math.isfinite(ts)):
                    raise AssertionError(f"bucket {key}: non-finite state {level}, {ts}")
                if level > capacity + 1e-6 or capacity <= 0 or rate <= 0:
                    raise AssertionError(f"bucket {key}: level {level} over capacity {capacity} (rate {rate})")

    def close(self) -> None:
        pass


class RateScope(NamedTuple):
    """Limits that apply under one name (e.g. `tenant:acme`, `key:3f2a...`); None: unlimited."""

    name: str
    rpm: int | None
    tpm: int | None


@dataclass(frozen=True)
class BucketHold:
    """Tokens held in these token buckets until `settle` (what a rate-limit admission took)."""

    token_specs: tuple[BucketSpec, ...]
    tokens: int


def format_duration(seconds: float) -> str:
    """OpenAI's x-ratelimit-reset-* style: 20ms, 1.5s, 6m0s, 1h2m3s."""
    seconds = max(seconds, 0.0)
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{secs:.3f}".rstrip("0").rstrip(".") + "s"
    if hours or minutes:
        text = f"{int(minutes)}m{text}"
    if hours:
        text = f"{int(hours)}h{text}"
    return text


@dataclass(frozen=True)
class BucketView:
    """The most constraining bucket of one kind, as the headers report it."""

    limit: int
    remaining: int
    reset_s: float  # until it is full again


@dataclass(frozen=True)
class RateLimitResult:
    """The outcome of one `reserve`: allowed with a reservation, or refused with a retry time."""

    allowed: bool
    requests: BucketView | None = None
    tokens: BucketView | None = None
    retry_after_s: float | None = None  # refused and waiting helps: when it will fit
    limited_by: str | None = None  # "requests" | "tokens" when refused
    too_large: bool = False  # needs more tokens than the bucket holds: waiting never helps
    reservation: BucketHold | None = None

    def headers(self) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for the buckets that apply."""
        out: dict[str, str] = {}
        for kind, view in (("requests", self.requests), ("tokens", self.tokens)):
            if view is not None:
                out[f"x-ratelimit-limit-{kind}"] = str(view.limit)
                out[f"x-ratelimit-remaining-{kind}"] = str(view.remaining)
                out[f"x-ratelimit-reset-{kind}"] = format_duration(view.reset_s)
        return out


def _specs(scopes: Sequence[RateScope], tokens: int, requests: bool = True) -> tuple[list[BucketSpec], list[float]]:
    specs, amounts = [], []
    for scope in scopes:
        if scope.rpm and requests:
            specs.append(BucketSpec(f"{scope.name}:requests", scope.rpm, scope.rpm / 60.0, "requests"))
            amounts.append(1.0)
        if scope.tpm:
            specs.append(BucketSpec(f"{scope.name}:tokens", scope.tpm, scope.tpm / 60.0, "tokens"))
            amounts.append(float(tokens))
    return specs, amounts


def _view(specs: Sequence[BucketSpec], levels: Sequence[float], kind: str) -> BucketView | None:
    """The bucket of `kind` with the least left (the one a client runs into first)."""
    pairs = [(s, lvl) for s, lvl in zip(specs, levels) if s.kind == kind]
    if not pairs:
        return None
    spec, level = min(pairs, key=lambda p: p[1] / p[0].capacity)
    return BucketView(int(spec.capacity), max(0, math.floor(level + _EPS)), (spec.capacity - level) / spec.rate)


class RateLimiter:
    """Reserves and settles requests and tokens across scopes, over one BucketStorage."""

    def __init__(self, storage: BucketStorage):
        self.storage = storage

    def reserve(self, scopes: Sequence[RateScope], tokens: int, requests: bool = True) -> RateLimitResult:
        """Take 1 request (unless `requests` is False: charged already) and `tokens` from each bucket."""
        specs, amounts = _specs(scopes, tokens, requests)
        if not specs:
            return RateLimitResult(True, reservation=BucketHold((), tokens))
        for spec in specs:
            if spec.kind == "tokens" and tokens > spec.capacity:
                return RateLimitResult(False, tokens=BucketView(int(spec.capacity), 0, 0.0),
                                       limited_by="tokens", too_large=True)
        taken = self.storage.take(specs, amounts)
        request_view, token_view = _view(specs, taken.levels, "requests"), _view(specs, taken.levels, "tokens")
        if taken.allowed:
            token_specs = tuple(s for s in specs if s.kind == "tokens")
            return RateLimitResult(True, request_view, token_view, reservation=BucketHold(token_specs, tokens))
        worst = max(range(len(specs)), key=lambda i: taken.waits[i])
        return RateLimitResult(False, request_view, token_view, retry_after_s=taken.waits[worst],
                               limited_by=specs[worst].kind)

    def settle(self, reservation: BucketHold, actual_tokens: int) -> None:
        """Give back reserved-but-unused tokens (or charge an overrun) once the request ends."""
        delta = reservation.tokens - actual_tokens
        if delta and reservation.token_specs:
            self.storage.give(reservation.token_specs, [float(delta)] * len(reservation.token_specs))

    def check_invariants(self) -> None:
        self.storage.check_invariants()
