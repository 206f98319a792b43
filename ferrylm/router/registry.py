"""The replica registry: model groups (name, aliases) → replicas and the policy that picks among
them; resolves what a client asked for, and lists candidates in routing order."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ferrylm.router.breaker import CircuitBreaker
from ferrylm.router.config import GroupConfig, RouterConfig
from ferrylm.router.policies import Policy, make_policy
from ferrylm.router.replica import Replica


@dataclass
class ModelGroup:
    config: GroupConfig
    replicas: list[Replica]
    policy: Policy
    tokenizer: object | None = None  # ferrylm Tokenizer once loaded (token counts, prefix hashes)
    tokenizer_error: str | None = None
    block_size: int | None = field(default=None)

    @property
    def name(self) -> str:
        return self.config.name

    def available(self, now: float | None = None, exclude: frozenset[str] = frozenset(),
                  adapter: str | None = None) -> list[Replica]:
        """Replicas that can take a request now; for a LoRA adapter, only those that hold it (adapter
        affinity: another replica would answer 404, or load it first)."""
        now = time.monotonic() if now is None else now
        return [r for r in self.replicas if r.url not in exclude and r.available(now)
                and (adapter is None or adapter in r.lora_adapters)]

    def adapters(self) -> list[str]:
        """LoRA adapters some replica of the group reports loaded (/load's lora_adapters)."""
        return sorted({name for r in self.replicas for name in r.lora_adapters})

    def upstream_block_size(self) -> int | None:
        """The block size the replicas report (they must agree for prefix hashes to match)."""
        sizes = {r.block_size for r in self.replicas if r.block_size}
        return sizes.pop() if len(sizes) == 1 else None

    def upstream_max_model_len(self) -> int | None:
        """The largest context window among the replicas (None before any reported one): a
        request may land on any of them, so reserving for the largest never under-reserves."""
        return max((r.max_model_len for r in self.replicas if r.max_model_len), default=None)


class ReplicaRegistry:
    """Every group and replica of a RouterConfig (a URL in two groups is two Replica objects:
    breakers and loads are per group, which keeps the accounting simple)."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.groups: dict[str, ModelGroup] = {}
        self._names: dict[str, str] = {}
        for g in config.groups:
            replicas = [Replica(url, g.name, CircuitBreaker(config.breaker_failures, config.breaker_open_s))
                        for url in g.upstreams]
            self.groups[g.name] = ModelGroup(g, replicas, make_policy(g.policy, g.upstreams, config))
            for name in (g.name, *g.aliases):
                self._names[name] = g.name

    @property
    def default_group(self) -> ModelGroup:
        return next(iter(self.groups.values()))

    def resolve(self, model: str | None) -> ModelGroup | None:
        """The group a model name or alias names (the first group when the client names none)."""
        if model is None:
            return self.default_group
        name = self._names.get(model)
        if name is not None:
            return self.groups[name]
        return next((g for g in self.groups.values() if model in g.adapters()), None)

    def is_adapter(self, model: str | None) -> bool:
        """Whether `model`, a name `resolve` found, names a LoRA adapter rather than a group or an
        alias (no second walk over the replicas' adapters)."""
        return model is not None and model not in self._names

    def model_names(self) -> list[tuple[str, str]]:
        """(name clients may use, group it routes to), groups first then aliases."""
        return sorted(self._names.items(), key=lambda kv: (kv[0] != kv[1], kv[0]))

    def replicas(self) -> list[Replica]:
        return [r for g in self.groups.values() for r in g.replicas]

    def fallback_chain(self, group: ModelGroup) -> list[ModelGroup]:
        """The group, then its fallbacks in order (each once)."""
        chain, seen = [group], {group.name}
        while chain[-1].config.fallback and chain[-1].config.fallback not in seen:
            chain.append(self.groups[chain[-1].config.fallback])
            seen.add(chain[-1].name)
        return chain

    def any_available(self) -> bool:
        now = time.monotonic()
        return any(r.available(now) for r in self.replicas())

    def check_invariants(self) -> None:
        for r in self.replicas():
            r.check_invariants()
