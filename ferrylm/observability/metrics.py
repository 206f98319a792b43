"""Prometheus metrics under vLLM's names with a `ferrylm:` prefix, in a registry owned by one app.

Latency histograms are observed as outputs reach the server (what a client sees); engine gauges
and counters are read from the engine's `LoadReport` at scrape time by a collector, so they can never drift.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ferrylm.load_report import LoadReport
from ferrylm.observability.buckets import ITL_BUCKETS, REQUEST_BUCKETS, TTFT_BUCKETS
from ferrylm.observability.tenant_metrics import TenantLatency, TenantMetricsConfig
from ferrylm.observability.throughput import ThroughputWindow
from ferrylm.outputs import FinishReason, RequestOutput

PREFIX = "ferrylm:"
THROUGHPUT_WINDOW_S = 10

StatsSource = Callable[[], LoadReport | None]


class EngineStatsCollector(Collector):
    """Turns the engine's latest stats snapshot into gauges and counters on every scrape."""

    def __init__(self, model_name: str, stats: StatsSource):
        self._model_name = model_name
        self._stats = stats

    def describe(self) -> Iterable[Metric]:
        return self._families(None)

    def collect(self) -> Iterable[Metric]:
        return self._families(self._stats())

    def _families(self, s: LoadReport | None) -> list[Metric]:
        gauges = [("num_requests_running", "Requests in the running batch.", s and s.num_running),
                  ("num_requests_waiting", "Requests waiting to be scheduled.", s and s.num_waiting),
                  ("num_requests_swapped", "Requests whose KV blocks are swapped out to host memory.",
                   s and s.num_swapped),
                  ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).",
                   s and s.kv_cache_usage),
                  ("kv_offload_usage_perc", "Fraction of the host KV tier's blocks holding a prefix.",
                   s and s.kv_offload_blocks_total and s.kv_offload_blocks_used / s.kv_offload_blocks_total),
                  ("kv_offload_disk_usage_perc", "Fraction of the disk KV tier's block files in use.",
                   s and s.kv_offload_disk_blocks_total
                   and s.kv_offload_disk_blocks_used / s.kv_offload_disk_blocks_total)]
        counters = [("prompt_tokens", "Prompt tokens admitted.", s and s.prompt_tokens_total),
                    ("generation_tokens", "Tokens generated.", s and s.generation_tokens_total),
                    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                     s and s.prefix_cache_queries),
                    ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s and s.prefix_cache_hits),
                    ("num_preemptions", "Requests preempted to free KV blocks.", s and s.num_preemptions),
                    ("num_swapped_out", "Preemptions by swap: KV blocks copied to host memory.",
                     s and s.num_swapped_out),
                    ("num_swapped_in", "Swapped requests whose KV blocks were copied back.", s and s.num_swapped_in),
                    ("num_swap_fallbacks", "Swaps that fell back to recompute (host pool full).",
                     s and s.num_swap_fallbacks),
                    ("spec_decode_num_drafts", "Speculative steps that verified a draft.",
                     s and s.spec_decode_num_drafts),
                    ("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.",
                     s and s.spec_decode_num_draft_tokens),
                    ("spec_decode_num_accepted_tokens", "Draft tokens the target model accepted.",
                     s and s.spec_decode_num_accepted_tokens),
                    ("kv_offload_hit_tokens", "Prompt tokens loaded back from the host KV tier instead of "
                     "recomputed (part of prefix_cache_hits).", s and s.kv_offload_hit_tokens),
                    ("kv_offload_blocks_out", "KV blocks copied to the host tier on eviction.",
                     s and s.kv_offload_blocks_out),
                    ("kv_offload_blocks_in", "KV blocks loaded back from the host tier.", s and s.kv_offload_blocks_in),
                    ("kv_offload_disk_hit_tokens", "Prompt tokens whose KV blocks were read up from the disk tier.",
                     s and s.kv_offload_disk_hit_tokens),
                    ("kv_offload_disk_blocks_written", "KV block files written to the disk tier.",
                     s and s.kv_offload_disk_blocks_written),
                    ("kv_offload_disk_blocks_read", "KV block files read back from the disk tier.",
                     s and s.kv_offload_disk_blocks_read),
                    ("kv_offload_disk_blocks_lost", "Disk tier files found missing, corrupt or another model's "
                     "(treated as misses), or whose write failed.", s and s.kv_offload_disk_blocks_lost),
                    ("kv_offload_disk_bytes_written", "Bytes of KV blocks written to the disk tier.",
                     s and s.kv_offload_disk_bytes_written),
                    ("kv_offload_disk_bytes_read", "Bytes of KV blocks read back from the disk tier.",
                     s and s.kv_offload_disk_bytes_read),
                    ("kv_offload_disk_read_seconds", "Seconds spent reading and checking disk tier files "
                     "(per block: divide by kv_offload_disk_blocks_read).", s and s.kv_offload_disk_read_seconds)]
        families: list[Metric] = []
        for name, doc, value in gauges:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self._model_name], float(value or 0))
            families.append(family)
        for name, doc, value in counters:
            counter = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            counter.add_metric([self._model_name], float(value or 0))
            families.append(counter)
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted at each draft position (0: the first).",
                                      labels=["model_name", "position"])
        for pos, value in enumerate(s.spec_decode_num_accepted_tokens_per_pos if s else ()):
            per_pos.add_metric([self._model_name, str(pos)], float(value))
        families.append(per_pos)
        families.append(_lora_info(s))
        return families


def _lora_info(s: LoadReport | None) -> Metric:
    """vLLM's `lora_requests_info` (under our prefix): the adapters of running and waiting requests as labels (comma
    separated), the value the scrape time; present only under --enable-lora."""
    family = GaugeMetricFamily(PREFIX + "lora_requests_info", "Running stats on LoRA requests.",
                               labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
    if s is not None and s.max_lora:
        family.add_metric([str(s.max_lora), ",".join(s.waiting_lora_adapters), ",".join(s.running_lora_adapters)],
                          time.time())
    return family


class ThroughputCollector(Collector):
    """`tokens_per_second_per_device`: generated tokens per second over the last THROUGHPUT_WINDOW_S
    seconds, divided by the devices the replica uses (its tensor-parallel size)."""

    def __init__(self, model_name: str, window: ThroughputWindow, devices: int):
        self._model_name, self._window, self._devices = model_name, window, devices

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily(PREFIX + "tokens_per_second_per_device",
                                   f"Tokens generated per second over the last {THROUGHPUT_WINDOW_S} s, per device "
                                   "(divided by --tensor-parallel-size).", labels=["model_name"])
        family.add_metric([self._model_name], self._window.rate() / self._devices)
        return [family]


class ReadCounter(Collector):
    """A counter some component keeps as a plain int, read at scrape time (no locking on its hot
    path): `ferrylm:rate_limiter_failures_total` from the gateway policy's count."""

    def __init__(self, name: str, doc: str, read: Callable[[], int]):
        self._name, self._doc, self._read = PREFIX + name, doc, read

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(self._name, self._doc)
        family.add_metric([], float(self._read()))
        return [family]


RATE_LIMITER_FAILURES = ("rate_limiter_failures", "Rate-limit store (Redis) errors, each answered per "
                         "--rate-limit-failure-mode (closed: 503, open: admitted unmetered).")


class ServerMetrics:
    """All of one server's metrics; `registry` is private to it (tests run several apps per process)."""

    def __init__(self, model_name: str, stats: StatsSource, tenants: TenantMetricsConfig | None = None,
                 devices: int = 1):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        # observed for requests the gateway policy names a tenant for
        self.tenants = TenantLatency(self.registry, tenants or TenantMetricsConfig(), PREFIX)
        self.throughput = ThroughputWindow(THROUGHPUT_WINDOW_S)
        self.registry.register(ThroughputCollector(model_name, self.throughput, devices))
        labels = ["model_name"]
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between consecutive tokens.", labels,
                             buckets=ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Request latency, arrival to finish.", labels,
                             buckets=REQUEST_BUCKETS, registry=self.registry).labels(model_name)
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds", "Time waiting before first scheduled.",
                                    labels, buckets=REQUEST_BUCKETS, registry=self.registry).labels(model_name)
        self._success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self.registry.register(EngineStatsCollector(model_name, stats))

    def count_finished(self, reason: FinishReason) -> None:
        self._success.labels(self.model_name, reason.value).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class SequenceTimer:
    """Latency bookkeeping for one engine request (one of a response's n sequences)."""

    def __init__(self, metrics: ServerMetrics, start: float, tenant: str | None = None):
        self._metrics = metrics
        self._start = start
        self._tenant = tenant  # the gateway's principal: per-tenant histograms too
        self._last_token: float | None = None
        self.done = False

    def on_output(self, out: RequestOutput, now: float | None = None) -> None:
        """Observe TTFT on the first token, ITL on the rest, and e2e/queue time at the finish."""
        now = time.monotonic() if now is None else now
        new_tokens = len(out.outputs[0].token_ids_delta)
        if new_tokens:
            self._metrics.throughput.add(new_tokens, now)
            if self._last_token is None:
                self._metrics.ttft.observe(now - self._start)
                if self._tenant is not None:
                    self._metrics.tenants.ttft(self._metrics.model_name, self._tenant, now - self._start)
            else:
                gap = (now - self._last_token) / new_tokens
                for _ in range(new_tokens):
                    self._metrics.itl.observe(gap)
                if self._tenant is not None:
                    self._metrics.tenants.itl(self._metrics.model_name, self._tenant, gap, new_tokens)
            self._last_token = now
        if out.finished:
            self._finish(out.outputs[0].finish_reason or FinishReason.STOP, now)
            m = out.metrics
            if m is not None and m.first_scheduled_time is not None:
                self._metrics.queue_time.observe(max(m.first_scheduled_time - m.arrival_time, 0.0))

    def on_abort(self, now: float | None = None) -> None:
        if not self.done:
            self._finish(FinishReason.ABORT, time.monotonic() if now is None else now)

    def _finish(self, reason: FinishReason, now: float) -> None:
        self.done = True
        self._metrics.e2e.observe(now - self._start)
        if self._tenant is not None:
            self._metrics.tenants.e2e(self._metrics.model_name, self._tenant, now - self._start)
        self._metrics.count_finished(reason)
