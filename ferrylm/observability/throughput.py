"""Generation throughput over a recent window, for `ferrylm:tokens_per_second_per_device`."""

from __future__ import annotations

import time
from collections import deque


class ThroughputWindow:
    """Tokens generated per second over the last `window_s` seconds, kept in one-second buckets
    (O(window) memory whatever the rate; the caller's event loop is its only writer)."""

    def __init__(self, window_s: int = 10, now: float | None = None):
        if window_s < 1:
            raise ValueError("the throughput window must be at least one second")
        self._window_s = window_s
        self._created = time.monotonic() if now is None else now
        self._buckets: deque[list[int]] = deque()  # [second, tokens], oldest first

    def add(self, tokens: int, now: float | None = None) -> None:
        second = int(time.monotonic() if now is None else now)
        if self._buckets and self._buckets[-1][0] == second:
            self._buckets[-1][1] += tokens
        else:
            self._buckets.append([second, tokens])
        self._evict(second)

    def rate(self, now: float | None = None) -> float:
        """Tokens per second over the window (over the time since start, if shorter)."""
        now = time.monotonic() if now is None else now
        self._evict(int(now))
        span = min(float(self._window_s), max(now - self._created, 1.0))
        return sum(tokens for _, tokens in self._buckets) / span

    def _evict(self, second: int) -> None:
        while self._buckets and self._buckets[0][0] <= second - self._window_s:
            self._buckets.popleft()
