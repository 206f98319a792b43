"""Admission control: shed load before it reaches the engine, from a stats snapshot alone.

Little's law, L = λW, read as W = L / λ: the queued work L (tokens still to prefill for the
waiting requests, plus the completions they will generate) divided by the recent drain rate λ
(tokens/s the engine processes while busy) projects how long a new request would wait to start.
When that exceeds the caller's tier budget the request is refused at once (429, Retry-After =
the time for the excess to drain), or with 503 when the engine is unhealthy. Deciding costs a
few arithmetic operations and no engine work.
"""

from __future__ import annotations

import math
import threading
from typing import NamedTuple

from ferrylm.gateway.config import AdmissionConfig
from ferrylm.gateway.errors import GatewayError, retry_headers


class EngineLoad(NamedTuple):
    """The fields of an engine stats snapshot that admission reads."""

    num_waiting: int
    num_running: int
    num_waiting_prompt_tokens: int
    kv_cache_usage: float
    healthy: bool = True
    tokens_total: int | None = None  # cumulative prompt + generated tokens processed, if reported

    @classmethod
    def from_stats(cls, stats: object, healthy: bool = True) -> "EngineLoad":
        """Read an EngineStats-like object (duck-typed: engine or remote replica)."""
        prompt, generated = getattr(stats, "prompt_tokens_total", None), getattr(stats, "generation_tokens_total", None)
        total = prompt + generated if isinstance(prompt, int) and isinstance(generated, int) else None
        return cls(int(stats.num_waiting), int(stats.num_running), int(stats.num_waiting_prompt_tokens),
                   float(stats.kv_cache_usage), healthy and bool(getattr(stats, "healthy", True)), total)

    @property
    def busy(self) -> bool:
        return self.num_waiting > 0 or self.num_running > 0


class DrainRateTracker:
    """Recent engine throughput (tokens/s, an EWMA over intervals when the engine was busy) and
    the mean completion length. Fed by snapshot counters when the engine reports them, otherwise
    by completed requests."""

    def __init__(self, half_life_s: float = 10.0, min_interval_s: float = 0.25,
                 default_completion_tokens: float = 128.0):
        self._half_life_s = half_life_s
        self._min_interval_s = min_interval_s
        self._lock = threading.Lock()
        self._rate: float | None = None
        self._last: tuple[int, float, bool] | None = None  # total, time, busy after
        self._from_counters = False
        self._completed_total = 0
        self._mean_completion = float(default_completion_tokens)

    @property
    def rate(self) -> float | None:
        return self._rate

    @property
    def mean_completion_tokens(self) -> float:
        return self._mean_completion

    def observe_snapshot(self, load: EngineLoad, now: float) -> None:
        if load.tokens_total is None:
            return
        with self._lock:
            self._from_counters = True
            self._observe(load.tokens_total, now, load.busy, load.busy)

    def observe_completion(self, tokens: int, completion_tokens: int, others_in_flight: bool, now: float) -> None:
        """A request ended having processed `tokens`; `others_in_flight`: the engine stays busy."""
        with self._lock:
            self._mean_completion += 0.05 * (completion_tokens - self._mean_completion)
            if not self._from_counters:
                self._completed_total += tokens
                self._observe(self._completed_total, now, True, others_in_flight)

    def _observe(self, total: int, now: float, busy_during: bool, busy_after: bool) -> None:
        """Update the EWMA with the interval since the last sample, if the engine was busy
        throughout it (idle time would otherwise read as a slow engine)."""
        last = self._last
        if last is None or total < last[0]:  # first sample, or the engine restarted
            self._last = (total, now, busy_after)
            return
        elapsed = now - last[1]
        if elapsed < self._min_interval_s:
            return
        if last[2] and busy_during:
            observed = (total - last[0]) / elapsed
            alpha = 1.0 - 0.5 ** (elapsed / self._half_life_s)
            self._rate = observed if self._rate is None else self._rate + alpha * (observed - self._rate)
        self._last = (total, now, busy_after)

    def check_invariants(self) -> None:
        if self._rate is not None and not (math.isfinite(self._rate) and self._rate >= 0):
            raise AssertionError(f"bad drain rate {self._rate}")
        if not self._mean_completion >= 0:
            raise AssertionError(f"bad mean completion {self._mean_completion}")


class AdmissionDecision(NamedTuple):
    admitted: bool
    priority: int
    projected_wait_s: float | None  # None: unknown (no drain rate yet, or no snapshot)
    status: int | None = None  # 429 or 503 when shed
    retry_after_s: float | None = None
    reason: str | None = None


class AdmissionController:
    """Pure decision logic: (load, tier, drain rate) → admit with a priority, or shed."""

    def __init__(self, config: AdmissionConfig):
        self.config = config

    def projected_wait_s(self, load: EngineLoad, drain_rate: float | None, mean_completion: float) -> float | None:
        backlog = load.num_waiting_prompt_tokens + load.num_waiting * mean_completion
        if load.kv_cache_usage >= self.config.kv_watermark and load.num_waiting:
            backlog += load.num_running * mean_completion / 2  # queued work waits for blocks to free up
        if backlog <= 0:
            return 0.0
        if not drain_rate or drain_rate <= 0:
            return None
        return backlog / drain_rate

    def decide(self, load: EngineLoad | None, tier: str, drain_rate: float | None,
               mean_completion: float) -> AdmissionDecision:
        cfg = self.config
        priority = cfg.priority(tier)
        if load is None or not cfg.enabled:
            return AdmissionDecision(True, priority, None)
        if not load.healthy:
            return AdmissionDecision(False, priority, None, 503, cfg.unhealthy_retry_after_s, "engine_unhealthy")
        wait = self.projected_wait_s(load, drain_rate, mean_completion)
        budget = cfg.wait_budget_s(tier)
        if cfg.max_num_waiting is not None and load.num_waiting >= cfg.max_num_waiting:
            return AdmissionDecision(False, priority, wait, 429, max(1.0, (wait or 0.0) - budget), "queue_full")
        if wait is not None and wait > budget:
            return AdmissionDecision(False, priority, wait, 429, max(1.0, wait - budget), "queue_wait")
        return AdmissionDecision(True, priority, wait)


def shed_error(decision: AdmissionDecision, tier: str) -> GatewayError:
    """The answer to a shed request: 503 when the engine is unhealthy, else 429; Retry-After."""
    headers = retry_headers(decision.retry_after_s)
    if decision.status == 503:
        return GatewayError(503, "The engine is currently unavailable; please retry shortly.", "server_error",
                            "engine_unavailable", headers)
    wait = f"{decision.projected_wait_s:.1f}s" if decision.projected_wait_s is not None else "unknown"
    return GatewayError(429, f"The server is overloaded (projected queue wait {wait} exceeds the '{tier}' tier's "
                             "budget); please retry later.", "server_error", "server_overloaded", headers)
