"""The "KV cache tiers" panel: the prefix cache's device pool, host tier (--kv-offload-cpu-gib) and
disk tier (--kv-offload-disk-path) side by side, from the LoadReport figures a reading keeps. Each
row has the tier's occupancy now, its hit tokens and blocks moved (totals, and rates over the
trailing window as the hit-rate chart's), and for the disk its mean load-back latency and lost files.
A tier that is off (no blocks) is a row saying so, every figure None: never zeros or NaN."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from ferrylm.load_report import LoadReport

# The tiers' occupancy is now; every other figure is cumulative.
NOW_FIELDS = frozenset({"kv_blocks_used", "kv_blocks_total", "kv_offload_blocks_used", "kv_offload_blocks_total",
                        "kv_offload_disk_blocks_used", "kv_offload_disk_blocks_total"})


class TierCounters(NamedTuple):
    """The tiers' figures at one moment, under LoadReport's names."""

    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int  # device pool and host tier hits (host hits include blocks the disk read up)
    kv_offload_hit_tokens: int
    kv_offload_blocks_out: int
    kv_offload_blocks_in: int
    kv_offload_blocks_used: int
    kv_offload_blocks_total: int
    kv_offload_disk_hit_tokens: int
    kv_offload_disk_blocks_written: int
    kv_offload_disk_blocks_read: int
    kv_offload_disk_blocks_lost: int
    kv_offload_disk_bytes_written: int
    kv_offload_disk_bytes_read: int
    kv_offload_disk_read_seconds: float
    kv_offload_disk_blocks_used: int
    kv_offload_disk_blocks_total: int


class TierRow(NamedTuple):
    """One tier in the panel. "out" is toward the slower tier (host: copied from the device pool; disk:
    files written), "in" back up (host: loaded into the device pool; disk: files read into host)."""

    tier: str  # "device", "host" or "disk"
    on: bool
    blocks_used: int | None = None
    blocks_total: int | None = None
    occupancy: float | None = None  # 0..1
    hit_tokens: int | None = None  # prompt tokens not recomputed thanks to this tier (cumulative)
    hit_tokens_per_s: float | None = None  # over the trailing window
    blocks_out: int | None = None
    blocks_in: int | None = None
    blocks_out_per_s: float | None = None
    blocks_in_per_s: float | None = None
    bytes_out: int | None = None  # disk only
    bytes_in: int | None = None
    bytes_out_per_s: float | None = None
    bytes_in_per_s: float | None = None
    load_latency_s: float | None = None  # disk only: mean seconds per block read, over the trailing window
    load_latency_total_s: float | None = None  # the same since the server started
    blocks_lost: int | None = None  # disk only: files found missing, corrupt or foreign, or unwritten


def tier_counters(loads: Sequence[LoadReport], ready: Sequence[LoadReport]) -> TierCounters | None:
    """The LoadReports' tier figures summed: cumulative ones over every report (so they stay monotonic
    when a replica goes down), occupancy over the ready ones. None when none is ready."""
    if not ready:
        return None
    return TierCounters(**{name: sum(getattr(r, name) for r in (ready if name in NOW_FIELDS else loads))
                           for name in TierCounters._fields})


def _grown(new: TierCounters, old: TierCounters, name: str) -> float:
    """The counter's growth; a reset (restarted replica) counts as none."""
    return max(0, getattr(new, name) - getattr(old, name))


def _per(num: float | None, den: float | None) -> float | None:
    return round(num / den, 6) if num is not None and den else None


def _occupancy(used: int, total: int) -> dict[str, Any]:
    return {"blocks_used": used, "blocks_total": total, "occupancy": _per(used, total)}


def _device_row(new: TierCounters, old: TierCounters, dt: float) -> TierRow:
    """prefix_cache_hits less what the host tier loaded back: the tokens the device pool itself held."""
    if new.kv_blocks_total <= 0:
        return TierRow("device", False)
    hits = _grown(new, old, "prefix_cache_hits") - _grown(new, old, "kv_offload_hit_tokens")
    return TierRow("device", True, **_occupancy(new.kv_blocks_used, new.kv_blocks_total),
                   hit_tokens=max(0, new.prefix_cache_hits - new.kv_offload_hit_tokens),
                   hit_tokens_per_s=_per(max(0.0, hits), dt))


def _host_row(new: TierCounters, old: TierCounters, dt: float) -> TierRow:
    if new.kv_offload_blocks_total <= 0:
        return TierRow("host", False)
    return TierRow("host", True, **_occupancy(new.kv_offload_blocks_used, new.kv_offload_blocks_total),
                   hit_tokens=new.kv_offload_hit_tokens,
                   hit_tokens_per_s=_per(_grown(new, old, "kv_offload_hit_tokens"), dt),
                   blocks_out=new.kv_offload_blocks_out, blocks_in=new.kv_offload_blocks_in,
                   blocks_out_per_s=_per(_grown(new, old, "kv_offload_blocks_out"), dt),
                   blocks_in_per_s=_per(_grown(new, old, "kv_offload_blocks_in"), dt))


def _disk_row(new: TierCounters, old: TierCounters, dt: float) -> TierRow:
    if new.kv_offload_disk_blocks_total <= 0:
        return TierRow("disk", False)
    return TierRow("disk", True, **_occupancy(new.kv_offload_disk_blocks_used, new.kv_offload_disk_blocks_total),
                   hit_tokens=new.kv_offload_disk_hit_tokens,
                   hit_tokens_per_s=_per(_grown(new, old, "kv_offload_disk_hit_tokens"), dt),
                   blocks_out=new.kv_offload_disk_blocks_written, blocks_in=new.kv_offload_disk_blocks_read,
                   blocks_out_per_s=_per(_grown(new, old, "kv_offload_disk_blocks_written"), dt),
                   blocks_in_per_s=_per(_grown(new, old, "kv_offload_disk_blocks_read"), dt),
                   bytes_out=new.kv_offload_disk_bytes_written, bytes_in=new.kv_offload_disk_bytes_read,
                   bytes_out_per_s=_per(_grown(new, old, "kv_offload_disk_bytes_written"), dt),
                   bytes_in_per_s=_per(_grown(new, old, "kv_offload_disk_bytes_read"), dt),
                   load_latency_s=_per(_grown(new, old, "kv_offload_disk_read_seconds"),
                                       _grown(new, old, "kv_offload_disk_blocks_read")),
                   load_latency_total_s=_per(new.kv_offload_disk_read_seconds, new.kv_offload_disk_blocks_read),
                   blocks_lost=new.kv_offload_disk_blocks_lost)


def tier_rows(new: TierCounters, old: TierCounters | None, dt: float) -> list[TierRow]:
    """The panel's rows for `new`, rates over the `dt` seconds since `old` (None or dt 0: no rates)."""
    old = old or new
    return [row(new, old, dt) for row in (_device_row, _host_row, _disk_row)]
