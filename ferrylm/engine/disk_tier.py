"""The disk tier under the host tier (--kv-offload-disk-path, --kv-offload-disk-gib): which block
hashes have a file, ids only. The runner's model/kv_disk.py owns the files; this index decides what
is written, read and deleted, and the step's SchedulerOutput carries the orders.

Inclusive, unlike the host tier: a block offloaded from the device pool to a host block is also
written to disk (once; asynchronously), and stays on disk when it is loaded back, so a restart of the
same model finds every prefix that left the device pool. A read lands in a host block first and is
only findable once the runner has checked the file; a file found missing, corrupt or written by
another model is dropped from the index (`lose`). Full, the tier deletes the least recently used file
of the owner holding most (OwnerLRU), like the host tier."""

from __future__ import annotations

from collections.abc import Iterable

from ferrylm.engine.prefix_tier import OwnerLRU


class DiskPrefixTier:
    """An index of at most `capacity` block files, seeded with what the directory held at start
    (`existing`: (block hash, owner), oldest first)."""

    def __init__(self, capacity: int, existing: Iterable[tuple[int, int]] = ()):
        self.capacity = capacity
        self._lru: OwnerLRU[int] = OwnerLRU()
        self._writes: dict[int, tuple[int, int, int]] = {}  # this step's: hash → (device block, hash, owner)
        self._deletes: list[tuple[int, int]] = []  # (hash, owner) of files this step removes (before its writes)
        for block_hash, owner in existing:
            if capacity < 1:
                self._deletes.append((block_hash, owner))  # no room at all: a smaller --kv-offload-disk-gib
            else:
                self._add(block_hash, owner)
        # files ordered written / ordered read / read and found good / found bad or failed to write
        self.blocks_written = self.blocks_read = self.blocks_loaded = self.blocks_lost = 0

    @property
    def num_used(self) -> int:
        return len(self._lru)

    def holds(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def store(self, block_id: int, block_hash: int, owner: int) -> None:
        """Order device block `block_id` (being evicted) written as `block_hash`'s file, unless the
        tier already holds it (then it is only refreshed)."""
        if block_hash in self._lru:
            self._lru.touch(block_hash)
            return
        if self.capacity < 1:
            return
        self._add(block_hash, owner)
        self._writes[block_hash] = (block_id, block_hash, owner)
        self.blocks_written += 1

    def _add(self, block_hash: int, owner: int) -> None:
        if len(self._lru) >= self.capacity:
            victim = self._lru.victim(owner)
            if victim is not None:
                self._forget(victim, self._lru.remove(victim))
        self._lru.add(block_hash, owner)

    def _forget(self, block_hash: int, owner: int) -> None:
        """The file goes: a write ordered this step is dropped instead (no file to delete yet)."""
        if self._writes.pop(block_hash, None) is None:
            self._deletes.append((block_hash, owner))

    def read(self, block_hash: int) -> int:
        """A read of `block_hash` is ordered: it is the most recently used. Its owner."""
        self._lru.touch(block_hash)
        self.blocks_read += 1
        return self._lru.owner(block_hash)

    def lose(self, block_hash: int) -> None:
        """The file is missing, corrupt or another model's (the runner found it so): never read it again."""
        if block_hash in self._lru:
            self._forget(block_hash, self._lru.remove(block_hash))
            self.blocks_lost += 1

    def take_orders(self) -> tuple[tuple[tuple[int, int, int], ...], tuple[tuple[int, int], ...]]:
        """This step's (writes, deletes); the runner deletes first."""
        writes, deletes = tuple(self._writes.values()), tuple(self._deletes)
        self._writes, self._deletes = {}, []
        return writes, deletes

    def check_invariants(self) -> None:
        self._lru.check()
        if len(self._lru) > max(self.capacity, 0):
            raise AssertionError("disk tier holds more files than its capacity")
