"""Circuit breaker for one replica: eject after consecutive failures, let one probe through
after a cool-down, close on its success (passive ejection, as Envoy's outlier detection)."""

from __future__ import annotations

import enum
import threading


class BreakerState(enum.IntEnum):
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    """`allow(now)` before sending; `record_success()` / `record_failure(now)` after."""

    def __init__(self, failure_threshold: int, open_s: float):
        self.failure_threshold = failure_threshold
        self.open_s = open_s
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.opened_at: float | None = None
        self.ejections = 0
        self._probe_in_flight = False
        self._lock = threading.Lock()

    def allow(self, now: float) -> bool:
        """Closed: yes. Open: no until the cool-down ends, then one half-open probe at a time."""
        with self._lock:
            if self.state is BreakerState.CLOSED:
                return True
            if self.state is BreakerState.OPEN and now - (self.opened_at or now) < self.open_s:
                return False
            if self._probe_in_flight:
                return False
            self.state = BreakerState.HALF_OPEN
            self._probe_in_flight = True
            return True

    def available(self, now: float) -> bool:
        """Would `allow` say yes (without taking the probe slot)?"""
        with self._lock:
            if self.state is BreakerState.CLOSED:
                return True
            cooled = self.state is BreakerState.HALF_OPEN or now - (self.opened_at or now) >= self.open_s
            return cooled and not self._probe_in_flight

    def release_probe(self) -> None:
        """The probe was taken but never decided (request cancelled, or failed through no fault of
        the replica): let the next request probe instead."""
        with self._lock:
            self._probe_in_flight = False

    def record_success(self) -> None:
        with self._lock:
            self.state = BreakerState.CLOSED
            self.consecutive_failures = 0
            self._probe_in_flight = False

    def record_failure(self, now: float) -> bool:
        """Count a failure; True if this one ejected the replica."""
        with self._lock:
            self.consecutive_failures += 1
            self._probe_in_flight = False
            if self.state is BreakerState.HALF_OPEN or (
                    self.state is BreakerState.CLOSED and self.consecutive_failures >= self.failure_threshold):
                self.state = BreakerState.OPEN
                self.opened_at = now
                self.ejections += 1
                return True
            return False

    def check_invariants(self) -> None:
        if self.state is BreakerState.OPEN and self.opened_at is None:
            raise AssertionError("open breaker without an opening time")
        if self._probe_in_flight and self.state is BreakerState.CLOSED:
            raise AssertionError("probe in flight on a closed breaker")
