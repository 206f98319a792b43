"""Percentiles from Prometheus histogram buckets, as PromQL's histogram_quantile computes them:
the bucket holding the q-th observation, then linear interpolation inside it. Applied to the
difference of two cumulative readings, it gives the percentile of what was observed in between."""

from __future__ import annotations

import math
from typing import NamedTuple


class Buckets(NamedTuple):
    """A histogram's cumulative counts: counts[i] observations were <= bounds[i] (the last bound is +Inf)."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]

    @property
    def total(self) -> float:
        return self.counts[-1] if self.counts else 0.0

    def minus(self, earlier: Buckets) -> Buckets:
        """What was observed since `earlier`; a counter reset (a restarted replica) reads as nothing."""
        if earlier.bounds != self.bounds:
            raise ValueError("histograms with different buckets cannot be subtracted")
        delta = tuple(a - b for a, b in zip(self.counts, earlier.counts))
        if any(d < 0 for d in delta):
            return Buckets(self.bounds, tuple(0.0 for _ in delta))
        return Buckets(self.bounds, delta)


def histogram_quantile(q: float, buckets: Buckets) -> float | None:
    """The q-quantile (0 <= q <= 1) of the observations, None when there are none. An answer in
    the +Inf bucket is the largest finite bound (the histogram knows no more)."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile {q} is not within [0, 1]")
    total = buckets.total
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, count in zip(buckets.bounds, buckets.counts):
        if count >= rank and count > below:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / (count - below)
        if not math.isinf(bound):
            lower = bound
        below = count
    return lower
