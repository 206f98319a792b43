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
from ferrylm.gateway.errors import retry_headers
from ferrylm.http.errors import APIError
from ferrylm.load_report import LoadReport


class DrainRateTracker:
    """Recent engine throughput (tokens/s, an EWMA over intervals when the engine was busy), the
    decode rate alone (generated tokens/s: output drains at this pace, prompt tokens far faster),
    and the mean completion length. Fed by snapshot counters when the engine reports them,
    otherwise by completed requests."""

    def __init__(self, half_life_s: float = 10.0, min_interval_s: float = 0.25,
                 default_completion_tokens: float = 128.0):
        self._half_life_s = half_life_s
        self._min_interval_s = min_interval_s
        self._lock = threading.Lock()
        self._rate: float | None = None
        self._decode_rate: float | None = None
        self._last: tuple[int, float, bool] | None = None  # total, time, busy after
        self._last_generated: int | None = None
        self._from_counters = False
        self._completed_total = 0
        self._mean_completion = float(default_completion_tokens)
        self._output_fraction = 1.0  # of max_tokens really generated; the prior assumes all of it

    @property
    def rate(self) -> float | None:
        return self._rate

    @property
    def decode_rate(self) -> float | None:
        return self._decode_rate

    @property
    def mean_completion_tokens(self) -> float:
        return self._mean_completion

    @property
    def output_fraction(self) -> float:
        """EWMA of completion_tokens / max_tokens: unlike a mean length it does not mislead when
        the mix of max_tokens changes (a burst of 1-token requests, then 500-token ones)."""
        return self._output_fraction

    def observe_snapshot(self, load: LoadReport, now: float) -> None:
        with self._lock:
            self._from_counters = True
            self._observe(load.tokens_total, now, load.busy, load.busy, load.generation_tokens_total)

    def observe_completion(self, tokens: int, completion_tokens: int, others_in_flight: bool, now: float,
                           max_tokens: int | None = None) -> None:
        """A request ended having processed `tokens`; `others_in_flight`: the engine stays busy."""
        with self._lock:
            self._mean_completion += 0.05 * (completion_tokens - self._mean_completion)
            if max_tokens:
                fraction = min(1.0, max(0, completion_tokens) / max_tokens)
                self._output_fraction += 0.1 * (fraction - self._output_fraction)
            if not self._from_counters:
                self._completed_total += tokens
                self._observe(self._completed_total, now, True, others_in_flight)

    def _observe(self, total: int, now: float, busy_during: bool, busy_after: bool,
                 generated: int | None = None) -> None:
        """Update the EWMAs with the interval since the last sample, if the engine was busy
        throughout it (idle time would otherwise read as a slow engine)."""
        last = self._last
        if last is None or total < last[0]:  # first sample, or the engine restarted
            self._last, self._last_generated = (total, now, busy_after), generated
            return
        elapsed = now - last[1]
        if elapsed < self._min_interval_s:
            return
        if last[2] and busy_during:
            alpha = 1.0 - 0.5 ** (elapsed / self._half_life_s)
            self._rate = _ewma(self._rate, (total - last[0]) / elapsed, alpha)
            if generated is not None and self._last_generated is not None and generated > self._last_generated:
                self._decode_rate = _ewma(self._decode_rate, (generated - self._last_generated) / elapsed, alpha)
        self._last, self._last_generated = (total, now, busy_after), generated

    def check_invariants(self) -> None:
        for rate in (self._rate, self._decode_rate):
            if rate is not None and not (math.isfinite(rate) and rate >= 0):
                raise AssertionError(f"bad drain rate {rate}")
        if not self._mean_completion >= 0:
            raise AssertionError(f"bad mean completion {self._mean_completion}")
        if not 0 <= self._output_fraction <= 1:
            raise AssertionError(f"bad output fraction {self._output_fraction}")


def _ewma(current: float | None, observed: float, alpha: float) -> float:
    return observed if current is None else current + alpha * (observed - current)


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

    def projected_wait_s(self, load: LoadReport, drain_rate: float | None, mean_completion: float,
                         output_fraction: float | None = None, decode_rate: float | None = None) -> float | None:
        """Work ahead of a new request / the rate it drains. With the engine's output budgets: while
        the batch has a slot for every queued request and this one (and KV is not short), only the
        queue's prompts are ahead of it; their output is generated beside its own, not before it.
        When the batch is full, the queue's output is ahead too (their max_tokens x the fraction
        requests really use; all of it for ignore_eos, at least min_tokens), plus the share of the
        running requests' remaining output that frees the slots the queue ahead of it needs."""
        if output_fraction is not None:
            def expected(total: int, certain: int) -> float:
                return certain + output_fraction * max(0, total - certain)

            full = (load.max_num_seqs is not None and load.num_running + load.num_waiting >= load.max_num_seqs) \
                or load.kv_cache_usage >= self.config.kv_watermark
            output = 0.0
            if full:
                output = expected(load.num_waiting_output_tokens, load.num_waiting_certain_output_tokens)
                if load.num_running and load.num_running_output_tokens:
                    share = min(1.0, (load.num_waiting + 1) / load.num_running)
                    output += expected(load.num_running_output_tokens, load.num_running_certain_output_tokens) * share
            if drain_rate and decode_rate:  # output drains at the decode pace, prompts at the overall one
                return load.num_waiting_prompt_tokens / drain_rate + output / decode_rate
            backlog = load.num_waiting_prompt_tokens + output
        else:
            backlog = load.num_waiting_prompt_tokens + load.num_waiting * mean_completion
            if load.kv_cache_usage >= self.config.kv_watermark and load.num_waiting:
                backlog += load.num_running * mean_completion / 2  # queued work waits for blocks to free up
        if backlog <= 0:
            return 0.0
        if not drain_rate or drain_rate <= 0:
            return None
        return backlog / drain_rate

    def decide(self, load: LoadReport | None, tier: str, drain_rate: float | None,
               mean_completion: float, output_fraction: float | None = None,
               decode_rate: float | None = None) -> AdmissionDecision:
        cfg = self.config
        priority = cfg.priority(tier)
        if load is None or not cfg.enabled:
            return AdmissionDecision(True, priority, None)
        if not load.healthy:
            return AdmissionDecision(False, priority, None, 503, cfg.unhealthy_retry_after_s, "engine_unhealthy")
        wait = self.projected_wait_s(load, drain_rate, mean_completion, output_fraction, decode_rate)
        budget = cfg.wait_budget_s(tier)
        if cfg.max_num_waiting is not None and load.num_waiting >= cfg.max_num_waiting:
            return AdmissionDecision(False, priority, wait, 429, max(1.0, (wait or 0.0) - budget), "queue_full")
        if wait is not None and wait > budget:
            return AdmissionDecision(False, priority, wait, 429, max(1.0, wait - budget), "queue_wait")
        return AdmissionDecision(True, priority, wait)


def shed_error(decision: AdmissionDecision, tier: str) -> APIError:
    """The answer to a shed request: 503 when the engine is unhealthy, else 429; Retry-After."""
    headers = retry_headers(decision.retry_after_s)
    if decision.status == 503:
        return APIError(503, "The engine is currently unavailable; please retry shortly.", code="engine_unavailable",
                        type_="server_error", headers=headers)
    wait = f"{decision.projected_wait_s:.1f}s" if decision.projected_wait_s is not None else "unknown"
    return APIError(429, f"The server is overloaded (projected queue wait {wait} exceeds the '{tier}' tier's "
                         "budget); please retry later.", code="server_overloaded", type_="server_error",
                    headers=headers)
