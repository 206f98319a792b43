"""Routing policies: given the available replicas of a model group and what a request will cost,
pick one. Each returns a Choice naming why, which the router counts in its metrics."""

from __future__ import annotations

import bisect
import hashlib
import itertools
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from ferrylm.gateway.routing.replica import Replica


class RouteContext(NamedTuple):
    """What routing knows about a request before sending it."""

    prompt_tokens: int
    expected_output: int
    block_hashes: tuple[int, ...] = ()  # the engine's prefix-cache hashes of the prompt's full blocks
    affinity_key: int | None = None  # fallback key when there are no block hashes (no tokenizer)


class Choice(NamedTuple):
    replica: Replica
    reason: str  # round_robin | least_outstanding | prefix_match | prefix_hash | spill | latency


class Policy(Protocol):
    name: str

    def choose(self, candidates: Sequence[Replica], ctx: RouteContext) -> Choice: ...

    def record(self, ctx: RouteContext, replica: Replica) -> None: ...


def least_outstanding(candidates: Sequence[Replica]) -> Replica:
    """Fewest outstanding tokens; ties go to fewer in-flight requests, then list order."""
    return min(candidates, key=lambda r: (r.outstanding_tokens, r.in_flight))


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[Replica], ctx: RouteContext) -> Choice:
        return Choice(candidates[next(self._counter) % len(candidates)], "round_robin")

    def record(self, ctx: RouteContext, replica: Replica) -> None:
        pass


class LeastOutstandingTokens:
    """Per replica, prompt tokens still to prefill plus expected output tokens still to decode,
    summed over its in-flight requests: a long prompt weighs what it costs, not one request."""

    name = "least-outstanding-tokens"

    def choose(self, candidates: Sequence[Replica], ctx: RouteContext) -> Choice:
        return Choice(least_outstanding(candidates), "least_outstanding")

    def record(self, ctx: RouteContext, replica: Replica) -> None:
        pass


class LatencyEWMA:
    """Lowest TTFT EWMA scaled by queue length (replicas never measured go first)."""

    name = "latency"

    def choose(self, candidates: Sequence[Replica], ctx: RouteContext) -> Choice:
        return Choice(min(candidates, key=lambda r: ((r.ttft_ewma_s or 0.0) * (1 + r.in_flight), r.in_flight)),
                      "latency")

    def record(self, ctx: RouteContext, replica: Replica) -> None:
        pass


def _point(value: str | int) -> int:
    return int.from_bytes(hashlib.blake2b(str(value).encode(), digest_size=8).digest(), "big")


class HashRing:
    """Consistent hashing with virtual nodes: adding or losing a replica moves ~1/n of the keys."""

    def __init__(self, urls: Sequence[str], vnodes: int = 64):
        self._ring = sorted((_point(f"{url}#{i}"), url) for url in urls for i in range(vnodes))
        self._points = [p for p, _ in self._ring]

    def walk(self, key: int) -> list[str]:
        """Replica URLs in ring order from `key`'s position (each once)."""
        start = bisect.bisect(self._points, _point(key))
        seen: dict[str, None] = {}
        for i in range(len(self._ring)):
            seen.setdefault(self._ring[(start + i) % len(self._ring)][1], None)
        return list(seen)


class PrefixAffinity:
    """Send a request where its prefix is most likely cached. The router remembers which replica
    it sent each block hash to (an LRU map, the router's picture of the fleet's prefix caches); the
    deepest remembered block wins. Unknown prefixes go by consistent hashing of the first blocks,
    so identical system prompts land together from the start. A preferred replica whose load is
    over max(spill_min_tokens, spill_factor x group mean) spills to the least-loaded one."""

    name = "prefix-affinity"

    def __init__(self, urls: Sequence[str], spill_factor: float, spill_min_tokens: int, map_size: int,
                 hash_blocks: int = 4):
        self.ring = HashRing(urls)
        self.spill_factor = spill_factor
        self.spill_min_tokens = spill_min_tokens
        self.map_size = map_size
        self.hash_blocks = hash_blocks
        self._owner: OrderedDict[int, str] = OrderedDict()
        self._lock = threading.Lock()

    def _remembered(self, ctx: RouteContext, by_url: dict[str, Replica]) -> Replica | None:
        with self._lock:
            for h in reversed(ctx.block_hashes):
                url = self._owner.get(h)
                if url is not None and url in by_url:
                    return by_url[url]
        return None

    def _ring_key(self, ctx: RouteContext) -> int | None:
        if ctx.block_hashes:
            return ctx.block_hashes[min(len(ctx.block_hashes), self.hash_blocks) - 1]
        return ctx.affinity_key

    def choose(self, candidates: Sequence[Replica], ctx: RouteContext) -> Choice:
        by_url = {r.url: r for r in candidates}
        preferred, reason = self._remembered(ctx, by_url), "prefix_match"
        if preferred is None:
            key = self._ring_key(ctx)
            if key is None:
                return Choice(least_outstanding(candidates), "least_outstanding")
            preferred = next(by_url[u] for u in self.ring.walk(key) if u in by_url)
            reason = "prefix_hash"
        mean = sum(r.outstanding_tokens for r in candidates) / len(candidates)
        if preferred.outstanding_tokens > max(self.spill_min_tokens, self.spill_factor * mean):
            lightest = least_outstanding(candidates)
            if lightest is not preferred:
                return Choice(lightest, "spill")
        return Choice(preferred, reason)

    def record(self, ctx: RouteContext, replica: Replica) -> None:
        """The replica now holds these blocks (or will once it prefills them)."""
        with self._lock:
            for h in ctx.block_hashes:
                self._owner[h] = replica.url
                self._owner.move_to_end(h)
            while len(self._owner) > self.map_size:
                self._owner.popitem(last=False)


def make_policy(name: str, urls: Sequence[str], config) -> Policy:
    """The policy named in the group config (`config` is the RouterConfig)."""
    if name == "round-robin":
        return RoundRobin()
    if name == "least-outstanding-tokens":
        return LeastOutstandingTokens()
    if name == "latency":
        return LatencyEWMA()
    if name == "prefix-affinity":
        return PrefixAffinity(urls, config.spill_factor, config.spill_min_tokens, config.affinity_map_size)
    raise ValueError(f"unknown routing policy {name!r}")
