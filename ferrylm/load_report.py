"""LoadReport: the one engine-load snapshot. The engine takes it, `/load` sends it, the router's
poller reads it back and sums a group's, admission control decides from it, metrics export it.

One type with one set of (vLLM-style) names, read strictly from JSON: a renamed or missing field
is a ValueError at the poller, never a silent default that makes a busy replica look idle.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class LoadReport:
    """An engine's (or a group of replicas') load at one moment."""

    num_waiting: int
    num_running: int
    num_waiting_prompt_tokens: int  # prompt tokens the waiting requests still have to prefill (tier hits excluded)
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_queries: int  # prompt tokens looked up (cumulative)
    prefix_cache_hits: int  # prompt tokens found cached (cumulative)
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    # Output tokens the requests may still generate (max_tokens minus generated): admission control
    # scales these by the fraction of max_tokens requests really use...
    num_waiting_output_tokens: int
    num_running_output_tokens: int
    # ...except this part of them, which will surely be generated (ignore_eos, min_tokens).
    num_waiting_certain_output_tokens: int
    num_running_certain_output_tokens: int
    max_num_seqs: int | None  # the batch size; None: not known
    healthy: bool = True
    # speculative decoding (cumulative): verifying steps, draft tokens, accepted ones, accepted per position
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = dataclasses.field(default_factory=list)
    # swap preemption: requests whose KV is in host memory now (not in num_waiting, as in vLLM), and
    # cumulative swaps out / in and swaps that fell back to recompute (host pool full)
    num_swapped: int = 0
    num_swapped_out: int = 0
    num_swapped_in: int = 0
    num_swap_fallbacks: int = 0
    # batch composition (cumulative): tokens scheduled as prefill / as decode, and the steps that ran them
    prefill_tokens_total: int = 0
    decode_tokens_total: int = 0
    num_steps_total: int = 0
    # LoRA (--enable-lora): adapters loaded (a router prefers a replica that holds the one asked for),
    # those of running and of waiting requests, and the adapters one step may use (0: no LoRA)
    lora_adapters: list[str] = dataclasses.field(default_factory=list)
    running_lora_adapters: list[str] = dataclasses.field(default_factory=list)
    waiting_lora_adapters: list[str] = dataclasses.field(default_factory=list)
    max_lora: int = 0
    num_waiting_cached_tokens: int = 0  # waiting requests' prompt tokens found in some cache tier on arrival
    # the prefix cache's host tier (--kv-offload-cpu-gib): prompt tokens loaded back from it instead of
    # recomputed (cumulative, part of prefix_cache_hits), blocks copied to it / back (cumulative), and
    # its occupancy now
    kv_offload_hit_tokens: int = 0
    kv_offload_blocks_out: int = 0
    kv_offload_blocks_in: int = 0
    kv_offload_blocks_used: int = 0
    kv_offload_blocks_total: int = 0
    # the disk tier under it (--kv-offload-disk-path): prompt tokens whose blocks were read up from disk,
    # block files written / read back / found missing-corrupt-foreign (cumulative), bytes moved and
    # seconds spent reading (cumulative; the load-back latency is seconds / blocks read), occupancy now
    kv_offload_disk_hit_tokens: int = 0
    kv_offload_disk_blocks_written: int = 0
    kv_offload_disk_blocks_read: int = 0
    kv_offload_disk_blocks_lost: int = 0
    kv_offload_disk_bytes_written: int = 0
    kv_offload_disk_bytes_read: int = 0
    kv_offload_disk_read_seconds: float = 0.0
    kv_offload_disk_blocks_used: int = 0
    kv_offload_disk_blocks_total: int = 0

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def tokens_total(self) -> int:
        """Tokens processed so far (prompt + generated): its rate is the engine's drain rate."""
        return self.prompt_tokens_total + self.generation_tokens_total

    @property
    def busy(self) -> bool:
        return self.num_waiting > 0 or self.num_running > 0 or self.num_swapped > 0

    @classmethod
    def empty(cls, *, healthy: bool = True) -> LoadReport:
        """No work and no capacity: what a group with no replica reporting looks like."""
        counts: dict = {f.name: 0 for f in dataclasses.fields(cls) if f.type in ("int", "float")}
        return cls(**counts, max_num_seqs=None, healthy=healthy)

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"kv_cache_usage": self.kv_cache_usage}

    @classmethod
    def from_json(cls, body: dict) -> LoadReport:
        """Strict: every field present with its type (extra keys ignored), else ValueError."""
        if not isinstance(body, dict):
            raise ValueError(f"a load report is a JSON object, not {type(body).__name__}")
        values = {}
        for f in dataclasses.fields(cls):
            if f.name not in body:
                raise ValueError(f"load report lacks {f.name!r}")
            value = body[f.name]
            if not _has_type(value, str(f.type)):
                raise ValueError(f"load report field {f.name!r} should be {f.type}, got {value!r}")
            values[f.name] = value
        return cls(**values)

    @classmethod
    def combine(cls, reports: list[LoadReport]) -> LoadReport:
        """A group of replicas as one engine: counts and KV blocks summed (so kv_cache_usage is
        the fleet's), the batch size summed when every replica reports one, healthy if any is."""
        if not reports:
            raise ValueError("no load reports to combine")
        counts: dict = {f.name: sum(getattr(r, f.name) for r in reports)
                        for f in dataclasses.fields(cls) if f.type in ("int", "float")}
        seqs = [r.max_num_seqs for r in reports]
        known = [s for s in seqs if s is not None]
        per_pos = [0] * max(len(r.spec_decode_num_accepted_tokens_per_pos) for r in reports)
        for r in reports:
            for i, v in enumerate(r.spec_decode_num_accepted_tokens_per_pos):
                per_pos[i] += v
        names: dict = {f.name: sorted({n for r in reports for n in getattr(r, f.name)})
                 for f in dataclasses.fields(cls) if f.type == "list[str]"}
        return cls(**counts, **names, max_num_seqs=sum(known) if len(known) == len(seqs) else None,
                   healthy=any(r.healthy for r in reports), spec_decode_num_accepted_tokens_per_pos=per_pos)


def _has_type(value: object, annotation: str) -> bool:
    """JSON's types against a field's annotation (a string, under postponed annotations)."""
    if annotation == "bool":
        return isinstance(value, bool)
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if annotation == "int":
        return is_int
    if annotation == "float":
        return is_int or (isinstance(value, float) and math.isfinite(value))
    if annotation == "int | None":
        return value is None or is_int
    if annotation == "list[int]":
        return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    if annotation == "list[str]":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    raise TypeError(f"no JSON rule for {annotation}")
