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
tier recycles its own share instead of flushing everyone's."""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ferrylm.engine.block_manager import BlockKey


class HostPrefixTier:
    """`num_blocks` host blocks with ids from `first_id`; LRU over the prefixes they hold."""

    def __init__(self, first_id: int, num_blocks: int):
        self.first_id, self.num_blocks = first_id, num_blocks
        self._entries: OrderedDict[BlockKey, tuple[int, int]] = OrderedDict()  # key → (host block, owner)
        self._owned: dict[int, OrderedDict[BlockKey, None]] = {}  # owner → its keys, LRU first
        self._free = list(range(first_id + num_blocks - 1, first_id - 1, -1))
        self._released: list[int] = []  # taken this step: free again at end_step
        self.blocks_out = self.blocks_in = 0  # cumulative copies device → host / host → device

    @property
    def num_used(self) -> int:
        return len(self._entries)

    def holds(self, key: BlockKey) -> bool:
        return key in self._entries

    def offload(self, block_id: int, key: BlockKey, owner: int = 0) -> tuple[int, int] | None:
        """The copy order (device block, host block) keeping an evicted device block here, evicting
        the largest owner's least recently used prefix when full; None when it is already here or no
        host block is free this step."""
        if key in self._entries:
            self._entries.move_to_end(key)
            self._owned[self._entries[key][1]].move_to_end(key)
            return None
        if self._free:
            host = self._free.pop()
        elif self._entries:
            # the owner that would hold most counting this block: a tie goes against the newcomer's owner
            host = self._evict_from(max(self._owned, key=lambda o: len(self._owned[o]) + (o == owner)))
        else:
            return None
        self._entries[key] = (host, owner)
        self._owned.setdefault(owner, OrderedDict())[key] = None
        self.blocks_out += 1
        return block_id, host

    def _evict_from(self, owner: int) -> int:
        """Drop `owner`'s least recently used prefix; its host block."""
        key, _ = self._owned[owner].popitem(last=False)
        if not self._owned[owner]:
            del self._owned[owner]
        return self._entries.pop(key)[0]

    def take(self, key: BlockKey) -> int:
        """The host block holding `key`, which leaves the tier (its K/V goes back to the device)."""
        host, owner = self._entries.pop(key)
        del self._owned[owner][key]
        if not self._owned[owner]:
            del self._owned[owner]
        self._released.append(host)
        self.blocks_in += 1
        return host

    def end_step(self) -> None:
        """This step's copies are ordered: the host blocks taken back may be reused."""
        self._free.extend(self._released)
        self._released = []

    def check_invariants(self) -> None:
        held = [host for host, _ in self._entries.values()] + self._free + self._released
        if sum(len(keys) for keys in self._owned.values()) != len(self._entries):
            raise AssertionError("host prefix tier owners disagree with its entries")
        if sorted(held) != list(range(self.first_id, self.first_id + self.num_blocks)):
            raise AssertionError("host prefix tier blocks are lost or held twice")
