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

from ferrylm.router.replica import Replica


class RouteContext(NamedTuple):
    """What routing knows about a request before sending it."""

    prompt_tokens: int
    expected_output: int
    block_hashes: tuple[int, ...] = ()  # the engine's prefix-cache hashes of the prompt's full blocks
    affinity_key: int | None = None  # fallback key when there are no block hashes (no tokenizer)
    block_size: int = 16  # tokens per block hash
    echo_chunks: int = 0  # completions with echo: the replica streams the prompt back first
    num_sequences: int = 1  # prompts × n: engine requests, each held against the tenant's concurrency
    billed_prompt_tokens: int = 0  # each prompt once (outputs.Usage.of), if the replica reports no usage
    prompt_token_ids: tuple[int, ...] = ()  # the one prompt's exact ids (disaggregated prefill), when known
    cache_salt: str | None = None  # the salt the replica hashes the prompt with (gateway/cache_salt.py)
    adapter: str | None = None  # the LoRA adapter asked for: only replicas that hold it are candidates
    session: str | None = None  # an agent session (X-Session-Id, else the body's user), scoped to the tenant


class Choice(NamedTuple):
    replica: Replica
    reason: str  # round_robin | least_outstanding | prefix_match | prefix_hash | session | spill | latency


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

    def walk(self, key: int | str) -> list[str]:
        """Replica URLs in ring order from `key`'s position (each once)."""
        start = bisect.bisect(self._points, _point(key))
        seen: dict[str, None] = {}
        for i in range(len(self._ring)):
            seen.setdefault(self._ring[(start + i) % len(self._ring)][1], None)
        return list(seen)


class PrefixAffinity:
    """Send a request where its prefix is most likely cached, unless that costs more than it saves.

    The router remembers which replica it last sent each block hash to (an LRU map: its picture of
    the fleet's prefix caches). Each replica's cost is its outstanding tokens minus the prompt
    tokens it would not have to prefill (`credit` x the deepest remembered block it holds), and the
    cheapest wins. So a long shared document sticks to its replica, while short prompts that share
    only the chat template's first blocks spread by load; a preferred replica more loaded than its
    saving is worth is spilled from. A prefix the router has never seen goes to its replica on a
    consistent-hash ring (credited with the first `hash_blocks` blocks), so identical system
    prompts land together from the start and several gateways agree without talking.

    A request of a known session (RouteContext.session) is credited with its whole prompt on the
    replica that served the session last: its context is there, in the device pool or the host tier
    (--kv-offload-cpu-gib), even when the prompt's block hashes are long forgotten here; a new
    session's home is its key's place on the ring."""

    name = "prefix-affinity"

    def __init__(self, urls: Sequence[str], credit: float, map_size: int, hash_blocks: int = 4):
        self.ring = HashRing(urls)
        self.credit = credit
        self.map_size = map_size
        self.hash_blocks = hash_blocks
        self._owner: OrderedDict[int, str] = OrderedDict()
        self._sessions: OrderedDict[str, str] = OrderedDict()  # session → the replica it was sent to last
        self._lock = threading.Lock()

    def _remembered_depths(self, ctx: RouteContext, urls: set[str]) -> dict[str, int]:
        """Per replica, the number of leading blocks it was last sent (deepest first wins)."""
        depths: dict[str, int] = {}
        with self._lock:
            for depth in range(len(ctx.block_hashes), 0, -1):
                url = self._owner.get(ctx.block_hashes[depth - 1])
                if url is not None and url in urls and url not in depths:
                    depths[url] = depth
        return depths

    def _ring_key(self, ctx: RouteContext) -> int | str | None:
        if ctx.session is not None:
            return ctx.session
        if ctx.block_hashes:
            return ctx.block_hashes[min(len(ctx.block_hashes), self.hash_blocks) - 1]
        return ctx.affinity_key

    def choose(self, candidates: Sequence[Replica], ctx: RouteContext) -> Choice:
        by_url = {r.url: r for r in candidates}
        saved = {url: d * ctx.block_size for url, d in self._remembered_depths(ctx, set(by_url)).items()}
        key = self._ring_key(ctx)
        walk = self.ring.walk(key or 0)  # ring order: the tie-break, and the home of unseen prefixes
        reason = "prefix_match"
        with self._lock:
            home = self._sessions.get(ctx.session) if ctx.session is not None else None
        if home in by_url:
            saved[home] = max(saved.get(home, 0), ctx.prompt_tokens)
            reason = "session"
        if not saved:
            if key is None:
                return Choice(least_outstanding(candidates), "least_outstanding")
            home = next(u for u in walk if u in by_url)
            saved = {home: min(len(ctx.block_hashes) or 1, self.hash_blocks) * ctx.block_size}
            reason = "prefix_hash"
        order = {url: i for i, url in enumerate(walk)}
        best = min(candidates, key=lambda r: (r.outstanding_tokens - self.credit * saved.get(r.url, 0),
                                              r.in_flight, order.get(r.url, 0)))
        if best.url in saved:
            return Choice(best, reason if reason != "session" or best.url == home else "prefix_match")
        return Choice(best, "spill" if reason in ("prefix_match", "session") else "least_outstanding")

    def record(self, ctx: RouteContext, replica: Replica) -> None:
        """The replica now holds these blocks (or will once it prefills them)."""
        with self._lock:
            for h in ctx.block_hashes:
                self._owner[h] = replica.url
                self._owner.move_to_end(h)
            while len(self._owner) > self.map_size:
                self._owner.popitem(last=False)
            if ctx.session is not None:
                self._sessions[ctx.session] = replica.url
                self._sessions.move_to_end(ctx.session)
                while len(self._sessions) > self.map_size:
                    self._sessions.popitem(last=False)


def make_policy(name: str, urls: Sequence[str], config) -> Policy:
    """The policy named in the group config (`config` is the RouterConfig)."""
    if name == "round-robin":
        return RoundRobin()
    if name in ("least-outstanding-tokens", "disaggregated"):  # disaggregated: decode replicas by load
        return LeastOutstandingTokens()
    if name == "latency":
        return LatencyEWMA()
    if name == "prefix-affinity":
        return PrefixAffinity(urls, config.affinity_credit, config.affinity_map_size)
    raise ValueError(f"unknown routing policy {name!r}")
