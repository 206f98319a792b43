"""DashboardSampler: one reading of an app's stats every second into a ring buffer covering the
last minutes, and the series the dashboard draws, derived once per reading (rates and per-step
averages from counter deltas, percentiles from histogram bucket deltas over a trailing window),
and the KV cache tiers table for the latest reading (tiers.py).

Owned by an app's state object (no global state); its task starts and stops with the app."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from ferrylm.observability.dashboard.quantiles import Buckets, histogram_quantile
from ferrylm.observability.dashboard.tiers import TierCounters, TierRow, tier_rows

log = logging.getLogger("ferrylm.dashboard")


@dataclass(frozen=True)
class DashboardConfig:
    interval_s: float = 1.0  # one reading per interval
    window_s: float = 600.0  # the ring buffer covers this much history
    percentile_window_s: float = 10.0  # each point's percentiles and hit rate cover this much

    def __post_init__(self) -> None:
        if not 0 < self.interval_s <= self.percentile_window_s <= self.window_s:
            raise ValueError("need 0 < interval_s <= percentile_window_s <= window_s")

    @property
    def capacity(self) -> int:
        return int(self.window_s / self.interval_s) + 1


class Counters(NamedTuple):
    """Cumulative counts (engine tokens, steps, prefix-cache lookups) at one moment."""

    prompt_tokens: int
    generation_tokens: int
    prefill_tokens: int  # tokens scheduled as prefill (prompt chunks, recomputation) over all steps
    decode_tokens: int  # tokens scheduled as decode (one per running sequence, plus its draft)
    steps: int  # engine steps that ran the model
    prefix_cache_queries: int
    prefix_cache_hits: int


class Gauges(NamedTuple):
    num_waiting: int
    num_running: int
    kv_cache_usage: float


class Health(NamedTuple):
    """One thing that can be up or down: the server itself, or one replica as the router sees it."""

    name: str
    state: str  # "ok", or why not ("loading", "draining", "not ready", "ejected", ...)
    ok: bool
    detail: dict


@dataclass(frozen=True)
class Reading:
    wall: float  # time.time(), for the chart's clock
    mono: float  # time.monotonic(), for rates
    counters: Counters | None  # None: nothing reports yet (engine loading, no replica polled)
    gauges: Gauges | None
    ttft: Buckets | None
    itl: Buckets | None  # None where it is not measured (the gateway)
    health: tuple[Health, ...] = ()
    tiers: TierCounters | None = None  # the prefix cache's tiers (None: nothing ready reports)


class Point(NamedTuple):
    """One column of every chart (None: nothing to show for that moment)."""

    t: float
    ttft_p50: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    generation_tokens_per_s: float | None
    prompt_tokens_per_s: float | None
    num_waiting: int | None
    num_running: int | None
    kv_cache_usage: float | None
    prefix_cache_hit_rate: float | None
    prefill_tokens_per_step: float | None
    decode_tokens_per_step: float | None
    steps_per_s: float | None
    healthy: int
    unhealthy: int


def _delta(new: Counters | None, old: Counters | None, name: str) -> int | None:
    """The counter's growth; a reset (restarted replica) counts as none."""
    if new is None or old is None:
        return None
    return max(0, getattr(new, name) - getattr(old, name))


def _ratio(num: float | None, den: float | None) -> float | None:
    return round(num / den, 6) if num is not None and den else None


def _percentiles(new: Buckets | None, old: Buckets | None) -> tuple[float | None, float | None]:
    if new is None:
        return None, None
    seen = new.minus(old) if old is not None and old.bounds == new.bounds else new
    p50, p99 = histogram_quantile(0.5, seen), histogram_quantile(0.99, seen)
    return (round(p50, 6) if p50 is not None else None, round(p99, 6) if p99 is not None else None)


def derive_point(cur: Reading, prev: Reading | None, trail: Reading | None) -> Point:
    """The point for `cur`: rates against the reading before it, percentiles and the hit rate over
    what happened since `trail` (the reading one percentile window back, or the oldest one)."""
    prev = prev or cur
    trail = trail or cur
    c, p, tr = cur.counters, prev.counters, trail.counters
    dt = cur.mono - prev.mono
    ttft = _percentiles(cur.ttft, trail.ttft)
    itl = _percentiles(cur.itl, trail.itl)
    steps = _delta(c, p, "steps")
    g = cur.gauges
    hit_rate = _ratio(_delta(c, tr, "prefix_cache_hits"), _delta(c, tr, "prefix_cache_queries"))
    ok = sum(h.ok for h in cur.health)
    return Point(t=round(cur.wall, 3), ttft_p50=ttft[0], ttft_p99=ttft[1], itl_p50=itl[0], itl_p99=itl[1],
                 generation_tokens_per_s=_ratio(_delta(c, p, "generation_tokens"), dt),
                 prompt_tokens_per_s=_ratio(_delta(c, p, "prompt_tokens"), dt),
                 num_waiting=g.num_waiting if g else None, num_running=g.num_running if g else None,
                 kv_cache_usage=round(g.kv_cache_usage, 6) if g else None,
                 prefix_cache_hit_rate=hit_rate,
                 prefill_tokens_per_step=_ratio(_delta(c, p, "prefill_tokens"), steps),
                 decode_tokens_per_step=_ratio(_delta(c, p, "decode_tokens"), steps),
                 steps_per_s=_ratio(steps, dt), healthy=ok, unhealthy=len(cur.health) - ok)


@dataclass
class DashboardSampler:
    """Takes a reading every `config.interval_s` with `read` and keeps the last `window_s` of points."""

    read: Callable[[], Reading]
    source: str  # "serve" or "gateway": the page says what it is looking at
    config: DashboardConfig = field(default_factory=DashboardConfig)
    notes: dict[str, str] = field(default_factory=dict)  # series a source does not measure, and why
    _readings: deque[Reading] = field(init=False)
    _points: deque[Point] = field(init=False)
    _tiers: tuple[float, list[TierRow]] | None = field(init=False, default=None)  # (seconds covered, rows)
    _task: asyncio.Task | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self._readings = deque(maxlen=self.config.capacity)
        self._points = deque(maxlen=self.config.capacity)

    def sample(self) -> Point:
        """Take one reading now and derive its point."""
        self.add(self.read())
        return self._points[-1]

    def add(self, reading: Reading) -> None:
        prev = self._readings[-1] if self._readings else None
        back = round(self.config.percentile_window_s / self.config.interval_s)
        trail = self._oldest_reporting(max(0, len(self._readings) - back))
        self._readings.append(reading)
        self._points.append(derive_point(reading, prev, trail))
        self._tiers = self._tier_panel(reading, trail)

    @staticmethod
    def _tier_panel(cur: Reading, trail: Reading | None) -> tuple[float, list[TierRow]] | None:
        """The tiers now, rates over the same trailing window as the hit rate (so they agree)."""
        if cur.tiers is None:
            return None
        old = trail.tiers if trail is not None else None
        dt = cur.mono - trail.mono if trail is not None and old is not None else 0.0
        return round(dt, 3), tier_rows(cur.tiers, old, dt)

    def _oldest_reporting(self, start: int) -> Reading | None:
        """The first reading from index `start` on that has counters (the engine loaded, a replica
        polled), so a window that begins before anything reported still covers what did."""
        for i in range(start, len(self._readings)):
            if self._readings[i].counters is not None:
                return self._readings[i]
        return self._readings[start] if start < len(self._readings) else None

    async def run(self) -> None:
        while True:
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a bad reading must not stop the dashboard for good
                log.warning("dashboard reading failed", exc_info=True)
            await asyncio.sleep(self.config.interval_s)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def summary(self) -> dict:
        """Percentiles, rates and the hit rate over the whole window (first reading to last)."""
        if not self._readings:
            return {}
        first, last = self._oldest_reporting(0) or self._readings[0], self._readings[-1]
        point = derive_point(last, first, first)
        return {"ttft_p50": point.ttft_p50, "ttft_p99": point.ttft_p99, "itl_p50": point.itl_p50,
                "itl_p99": point.itl_p99, "generation_tokens_per_s": point.generation_tokens_per_s,
                "prefix_cache_hit_rate": point.prefix_cache_hit_rate,
                "prefill_tokens_per_step": point.prefill_tokens_per_step,
                "decode_tokens_per_step": point.decode_tokens_per_step,
                "seconds": round(last.mono - first.mono, 3)}

    def to_json(self) -> dict:
        """What /dashboard/data answers: the series column by column, a summary, the current health."""
        series = {name: [getattr(p, name) for p in self._points] for name in Point._fields}
        latest = self._readings[-1] if self._readings else None
        return {"source": self.source, "interval_s": self.config.interval_s, "window_s": self.config.window_s,
                "percentile_window_s": self.config.percentile_window_s, "now": round(time.time(), 3),
                "num_points": len(self._points), "series": series, "summary": self.summary(),
                "health": [h._asdict() for h in latest.health] if latest else [], "notes": dict(self.notes),
                "kv_tiers": self._tiers_json()}

    def _tiers_json(self) -> dict | None:
        """The tiers panel: None until something ready reports."""
        if self._tiers is None:
            return None
        seconds, rows = self._tiers
        return {"seconds": seconds, "tiers": [r._asdict() for r in rows]}

    def check_invariants(self) -> None:
        if len(self._points) != len(self._readings) or len(self._readings) > self.config.capacity:
            raise AssertionError("dashboard points and readings out of step")
        monos = [r.mono for r in self._readings]
        if monos != sorted(monos):
            raise AssertionError("dashboard readings out of time order")
