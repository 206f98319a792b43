"""The host-RAM tier under the device prefix cache (--kv-offload-cpu-gib): a cached block evicted
from the device pool is copied to a host block instead of being lost, and a prompt whose prefix
misses the device pool but hits here is loaded back before it is scheduled (vLLM's CPU offload,
SGLang's HiCache idea). Ids only, like BlockManager: the runner copies the blocks when the step's
SchedulerOutput says so (out before in, both before the forward), in the host blocks after swap
preemption's.

Exclusive: a block's K/V lives in the device pool or here, not both. A host block taken back this
step is reused only from the next one (its copy-in runs after this step's copies out).

Fair between owners (a block's owner is its prefix chain's root: tenant salt and adapter): when full,
the owner holding the most blocks gives up its least recently used one, so a tenant flooding the
tier recycles its own share instead of flushing everyone's (OwnerLRU, shared with the disk tier).

A block read back from the disk tier (disk_tier.py) first lands in a host block reserved here: it is
not findable, nor evictable, until the runner has read and checked its file (`confirm`), or dropped
(`cancel`)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from ferrylm.engine.block_manager import BlockKey

K = TypeVar("K", bound=Hashable)


class OwnerLRU(Generic[K]):
    """Keys with an owner each, in LRU order overall and per owner; the victim of a full tier is the
    least recently used key of the owner that would hold most."""

    def __init__(self) -> None:
        self._owner: OrderedDict[K, int] = OrderedDict()
        self._owned: dict[int, OrderedDict[K, None]] = {}  # owner → its keys, LRU first

    def __len__(self) -> int:
        return len(self._owner)

    def __contains__(self, key: object) -> bool:
        return key in self._owner

    def add(self, key: K, owner: int) -> None:
        if key in self._owner:  # under another owner: one entry, the latest
            self.remove(key)
        self._owner[key] = owner
        self._owned.setdefault(owner, OrderedDict())[key] = None

    def touch(self, key: K) -> None:
        self._owner.move_to_end(key)
        self._owned[self._owner[key]].move_to_end(key)

    def owner(self, key: K) -> int:
        return self._owner[key]

    def remove(self, key: K) -> int:
        """Forget `key`; its owner."""
        owner = self._owner.pop(key)
        del self._owned[owner][key]
        if not self._owned[owner]:
            del self._owned[owner]
        return owner

    def victim(self, newcomer: int, protected: frozenset[K] | set[K] = frozenset()) -> K | None:
        """The key to drop for one of `newcomer`'s: the least recently used of the owner that would hold
        most (a tie goes against the newcomer's owner), skipping `protected` keys; None if all are."""
        for owner in sorted(self._owned, key=lambda o: len(self._owned[o]) + (o == newcomer), reverse=True):
            for key in self._owned[owner]:
                if key not in protected:
                    return key
        return None

    def keys(self) -> list[K]:
        return list(self._owner)

    def check(self) -> None:
        if sum(len(keys) for keys in self._owned.values()) != len(self._owner):
            raise AssertionError("a tier's owners disagree with its entries")


class HostPrefixTier:
    """`num_blocks` host blocks with ids from `first_id`; LRU over the prefixes they hold."""

    def __init__(self, first_id: int, num_blocks: int):
        self.first_id, self.num_blocks = first_id, num_blocks
        self._lru: OwnerLRU[BlockKey] = OwnerLRU()
        self._host: dict[BlockKey, int] = {}  # key → host block (findable entries)
        self._pending: dict[BlockKey, tuple[int, int]] = {}  # key → (host block, owner), read from disk this step
        self._free = list(range(first_id + num_blocks - 1, first_id - 1, -1))
        self._released: list[int] = []  # taken this step: free again at end_step
        self.blocks_out = self.blocks_in = 0  # cumulative copies device → host / host → device

    @property
    def num_used(self) -> int:
        return len(self._host) + len(self._pending)

    def holds(self, key: BlockKey) -> bool:
        return key in self._host

    def offload(self, block_id: int, key: BlockKey, owner: int = 0) -> tuple[int, int] | None:
        """The copy order (device block, host block) keeping an evicted device block here, evicting
        the largest owner's least recently used prefix when full; None when it is already here (or
        being read up from disk into a reserved block) or no host block is free this step."""
        if key in self._pending:
            return None
        if key in self._host:
            self._lru.touch(key)
            return None
        host = self._block_for(owner)
        if host is None:
            return None
        self._host[key] = host
        self._lru.add(key, owner)
        self.blocks_out += 1
        return block_id, host

    def reserve(self, key: BlockKey, owner: int, protected: frozenset[BlockKey] | set[BlockKey] = frozenset()
                ) -> int | None:
        """A host block for `key`'s K/V read back from disk this step (pending until `confirm`), never
        evicting a `protected` prefix (the same request's host hits); None when it is already here or
        no block can be had."""
        if key in self._host or key in self._pending:
            return None
        host = self._block_for(owner, protected)
        if host is not None:
            self._pending[key] = (host, owner)
        return host

    def confirm(self, key: BlockKey) -> None:
        """The disk read into `key`'s reserved block succeeded: it is findable from now on."""
        host, owner = self._pending.pop(key)
        self._host[key] = host
        self._lru.add(key, owner)

    def cancel(self, key: BlockKey) -> None:
        """The disk read failed: the reserved block is free again (from the next step)."""
        host, _ = self._pending.pop(key)
        self._released.append(host)

    def _block_for(self, owner: int, protected: frozenset[BlockKey] | set[BlockKey] = frozenset()) -> int | None:
        if self._free:
            return self._free.pop()
        victim = self._lru.victim(owner, protected) if self._lru else None
        if victim is None:
            return None
        self._lru.remove(victim)
        return self._host.pop(victim)

    def take(self, key: BlockKey) -> int:
        """The host block holding `key`, which leaves the tier (its K/V goes back to the device)."""
        host = self._host.pop(key)
        self._lru.remove(key)
        self._released.append(host)
        self.blocks_in += 1
        return host

    def end_step(self) -> None:
        """This step's copies are ordered: the host blocks taken back may be reused."""
        self._free.extend(self._released)
        self._released = []

    def check_invariants(self) -> None:
        self._lru.check()
        if set(self._lru.keys()) != set(self._host):
            raise AssertionError("host prefix tier's LRU disagrees with its entries")
        held = list(self._host.values()) + [h for h, _ in self._pending.values()] + self._free + self._released
        if sorted(held) != list(range(self.first_id, self.first_id + self.num_blocks)):
            raise AssertionError("host prefix tier blocks are lost or held twice")
