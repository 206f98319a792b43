"""Paged KV block accounting with automatic prefix caching (no tensors here; ids only).

A full block is identified by a hash chained over its parent's hash and its token ids, so two
requests sharing a prefix share its blocks. Freed blocks keep their hash and stay findable until
they are reused: the free queue is in LRU order and eviction happens lazily on allocation.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from ferrylm.engine.disk_tier import DiskPrefixTier
from ferrylm.engine.prefix_tier import HostPrefixTier
from ferrylm.scheduler_output import DiskOrders

BlockKey = tuple[int, tuple[int, ...]]  # (parent block hash, token ids of this block)
# The "parent" of an unsalted prompt's first block (a salted prompt's is root_hash(salt)).
ROOT_HASH = 0


def root_hash(cache_salt: str | None, lora_name: str | None = None) -> int:
    """The parent of a prompt's first block: ROOT_HASH without a salt or adapter, else one derived from
    the salt (vLLM's cache_salt) and the LoRA adapter's name, so prompts under different salts, or run
    through different adapters (whose K/V differ), never share a block. sha256, not hash(): str hashes
    differ between processes, and a KV transfer compares hashes across processes."""
    if not cache_salt and not lora_name:
        return ROOT_HASH
    seed = b"salt\0" + (cache_salt or "").encode("utf-8", "surrogatepass")
    if lora_name:
        seed += b"\0lora\0" + lora_name.encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.sha256(seed).digest()[:16], "little")


def hash_block_tokens(parent_hash: int, tokens: tuple[int, ...]) -> int:
    """Chained block hash (128 bits of sha256, as vLLM moved to): Python's tuple hash is 64 bits
    and not collision-resistant, so a tenant could craft a prompt whose chain collides with another's."""
    digest = hashlib.sha256(parent_hash.to_bytes(16, "little") + array("q", tokens).tobytes()).digest()
    return int.from_bytes(digest[:16], "little")


def block_hashes(token_ids: list[int], block_size: int, num_blocks: int | None = None,
                 cache_salt: str | None = None) -> list[int]:
    """Hashes of the leading full blocks of `token_ids` (the router uses the same function)."""
    full = len(token_ids) // block_size if num_blocks is None else num_blocks
    hashes: list[int] = []
    parent = root_hash(cache_salt)
    for i in range(full):
        parent = hash_block_tokens(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        hashes.append(parent)
    return hashes


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    key: BlockKey | None = None  # set while the block is registered in the prefix cache
    owner: int = 0  # the cache root (tenant, adapter) of the request that registered it

    @property
    def block_hash(self) -> int | None:
        return None if self.key is None else hash_block_tokens(*self.key)


class BlockPool:
    """All blocks, the LRU free queue, and the prefix-cache map from key to block."""

    def __init__(self, num_blocks: int):
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[BlockKey, int] = {}

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self, n: int, evicted: list[tuple[int, BlockKey, int]] | None = None) -> list[int]:
        """Take n blocks from the LRU end, evicting their cache entries; caller checked num_free.
        `evicted` collects (block id, key, owner) of each cached block evicted (its K/V is still there)."""
        ids = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.key is not None:
                del self.cached[block.key]
                if evicted is not None:
                    evicted.append((block_id, block.key, block.owner))
                block.key = None
            block.ref_cnt = 1
            ids.append(block_id)
        return ids

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks (removing them from the free queue if unreferenced)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self.free_queue[block_id]
            block.ref_cnt += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop a reference; unreferenced blocks join the free queue (tail blocks evicted first)."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block_id] = None

    def register(self, block_id: int, key: BlockKey, owner: int = 0) -> None:
        """Make a full block findable by key (first writer wins; duplicates stay private)."""
        if key not in self.cached and self.blocks[block_id].key is None:
            self.cached[key] = block_id
            self.blocks[block_id].key, self.blocks[block_id].owner = key, owner

    def lookup(self, key: BlockKey) -> int | None:
        return self.cached.get(key)


class BlockManager:
    """Per-request block tables over a BlockPool, with prefix-cache lookups and registration."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 tier: HostPrefixTier | None = None, disk: DiskPrefixTier | None = None):
        """`tier`: the host-RAM tier evicted cached blocks go to (--kv-offload-cpu-gib; None: lost);
        `disk`: the disk tier under it (--kv-offload-disk-path; read back through host blocks)."""
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.tables: dict[str, list[int]] = {}
        self._hashed: dict[str, list[int]] = {}  # request → hashes of its registered full blocks
        self.tier = tier if enable_prefix_caching else None
        # this step's copy orders for the tier: (device, host) out and (host, device) in
        self.tier_out: list[tuple[int, int]] = []
        self.tier_in: list[tuple[int, int]] = []
        self.disk = disk if self.tier is not None else None
        self._disk_reads: dict[int, tuple[BlockKey, int]] = {}  # block hash → (key, host block), until settled
        self._disk_read_orders: list[tuple[int, int, int]] = []  # this step's (block hash, owner, host block)

    # -- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by a request (cached-but-free blocks count as free)."""
        return 1.0 - self.pool.num_free / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    def find_cached_prefix(self, token_ids: list[int], root: int = ROOT_HASH) -> list[int]:
        """Blocks holding the longest cached prefix, leaving at least one token to compute. `root`
        is the request's root_hash(cache_salt): only prompts under the same salt share blocks."""
        if not self.enable_prefix_caching:
            return []
        return self._cached_chain(token_ids, (len(token_ids) - 1) // self.block_size, root)

    def cached_blocks(self, token_ids: list[int], root: int = ROOT_HASH) -> list[int]:
        """Blocks holding the leading full blocks of `token_ids` that are cached (the prefix a KV
        transfer can send), up to the first that is not."""
        return self._cached_chain(token_ids, len(token_ids) // self.block_size, root)

    def tier_continuation(self, token_ids: list[int], device_blocks: list[int], root: int = ROOT_HASH
                          ) -> list[BlockKey]:
        """Keys of the blocks after `device_blocks` (find_cached_prefix's) that the host tier holds,
        in chain order, leaving at least one token to compute. The chain resumes from the last device
        block's hash: the device part is not hashed again."""
        if self.tier is None:
            return []
        last = self.pool.blocks[device_blocks[-1]].block_hash if device_blocks else None  # hits are registered
        parent = root if last is None else last
        keys: list[BlockKey] = []
        for key in self._chain(token_ids, len(device_blocks), (len(token_ids) - 1) // self.block_size, parent):
            if not self.tier.holds(key):
                break
            keys.append(key)
        return keys

    def disk_continuation(self, token_ids: list[int], device_blocks: list[int], tier_keys: list[BlockKey],
                          root: int = ROOT_HASH) -> list[BlockKey]:
        """Keys of the blocks after the device pool's and the host tier's hits whose file the disk tier
        holds, in chain order, leaving at least one token to compute."""
        if self.disk is None:
            return []
        if tier_keys:
            parent = hash_block_tokens(*tier_keys[-1])
        else:
            last = self.pool.blocks[device_blocks[-1]].block_hash if device_blocks else None
            parent = root if last is None else last
        start = len(device_blocks) + len(tier_keys)
        keys: list[BlockKey] = []
        for key in self._chain(token_ids, start, (len(token_ids) - 1) // self.block_size, parent):
            if not self.disk.holds(hash_block_tokens(*key)):
                break
            keys.append(key)
        return keys

    def probe_cached_tokens(self, token_ids: list[int], root: int = ROOT_HASH) -> int:
        """Prompt tokens a request would not prefill if scheduled now: the prefix found in the device
        pool, then the host tier, then the disk tier (a read, hashing only; what admission estimates)."""
        device = self.find_cached_prefix(token_ids, root)
        tier = self.tier_continuation(token_ids, device, root)
        disk = self.disk_continuation(token_ids, device, tier, root)
        return (len(device) + len(tier) + len(disk)) * self.block_size

    def load_from_disk(self, keys: list[BlockKey], owner: int, tier_keys: list[BlockKey] | None = None) -> int:
        """Order the disk tier's files of `keys` read into host blocks this step (findable in the host
        tier from the next step, once the runner has checked them), never evicting the same request's
        host hits `tier_keys` to make room; how many were ordered (host blocks may run out)."""
        if self.disk is None or self.tier is None:
            return 0
        ordered = 0
        protected = set(tier_keys or ())
        for key in keys:
            block_hash = hash_block_tokens(*key)
            host = self.tier.reserve(key, owner, protected)
            if host is None:
                break
            file_owner = self.disk.read(block_hash)
            self._disk_reads[block_hash] = (key, host)
            self._disk_read_orders.append((block_hash, file_owner, host))
            ordered += 1
        return ordered

    def settle_disk(self, lost: tuple[int, ...] | list[int]) -> None:
        """The runner ran this step's DiskOrders: reads not `lost` become host-tier hits; a lost hash
        (failed read or write) is forgotten by the disk tier."""
        if self.disk is None:
            return
        gone = set(lost)
        for block_hash, (key, _) in self._disk_reads.items():
            if block_hash in gone:
                self.tier.cancel(key)  # type: ignore[union-attr]
            else:
                self.tier.confirm(key)  # type: ignore[union-attr]
                self.disk.blocks_loaded += 1
        self._disk_reads = {}
        for block_hash in gone:
            self.disk.lose(block_hash)

    def _cached_chain(self, token_ids: list[int], max_blocks: int, root: int) -> list[int]:
        found: list[int] = []
        for key in self._chain(token_ids, 0, max_blocks, root):
            block_id = self.pool.lookup(key)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def _chain(self, token_ids: list[int], start: int, stop: int, parent: int) -> Iterator[BlockKey]:
        """The keys of blocks start..stop-1 of `token_ids`, `parent` being block start-1's hash (each
        next parent is hashed only when the caller asks for the next key)."""
        for i in range(start, stop):
            key = (parent, tuple(token_ids[i * self.block_size:(i + 1) * self.block_size]))
            yield key
            parent = hash_block_tokens(*key)

    # -- mutations -----------------------------------------------------------------------
    def stage_import(self, token_ids: list[int], num_blocks: int,
                     root: int = ROOT_HASH) -> tuple[list[tuple[int, int, BlockKey]], list[int]]:
        """First half of caching K/V computed elsewhere (disaggregated prefill) for the first
        `num_blocks` full blocks of `token_ids`: ((block index, fresh block id, key) of each block the
        caller must now fill, every block held). Nothing is registered yet: the fresh blocks are held
        but unfindable until `commit_import`, so a failed write never leaves a hash pointing at garbage
        (`abort_import` gives them back). Blocks already cached are skipped; stops where the free pool
        runs out (a chain is only findable from its start)."""
        if not self.enable_prefix_caching:
            return [], []
        held: list[int] = []
        fill: list[tuple[int, int, BlockKey]] = []
        parent = root
        for i in range(min(num_blocks, len(token_ids) // self.block_size)):
            key = (parent, tuple(token_ids[i * self.block_size:(i + 1) * self.block_size]))
            block_id = self.pool.lookup(key)
            if block_id is not None:
                self.pool.touch([block_id])
            elif self.pool.num_free:
                block_id = self.pool.allocate(1)[0]
                fill.append((i, block_id, key))
            else:
                break
            held.append(block_id)
            parent = hash_block_tokens(*key)
        return fill, held

    def commit_import(self, fill: list[tuple[int, int, BlockKey]], held: list[int]) -> None:
        """The staged blocks' K/V is written: register them and let them go, unreferenced and
        evictable like any finished request's."""
        for _, block_id, key in fill:
            if self.pool.lookup(key) is None:
                self.pool.register(block_id, key)
        self.pool.release(held)

    def abort_import(self, held: list[int]) -> None:
        """The staged write failed: give the blocks back unregistered."""
        self.pool.release(held)

    def allocate_slots(self, request_id: str, token_ids: list[int], num_computed: int, num_new: int,
                       cached_blocks: list[int] | None = None, root: int = ROOT_HASH,
                       tier_keys: list[BlockKey] | None = None) -> bool:
        """Grow the table so tokens [0, num_computed + num_new) have slots; False (no change) if full.

        `cached_blocks` (from find_cached_prefix, only at first admission) become the table's head,
        then fresh blocks that the host tier's `tier_keys` (tier_continuation) are loaded into.
        """
        cached_blocks, tier_keys = cached_blocks or [], tier_keys or []
        table = self.tables.get(request_id, [])
        needed = self.blocks_needed(num_computed + num_new) - len(table) - len(cached_blocks)
        evictable_hits = sum(1 for b in cached_blocks if self.pool.blocks[b].ref_cnt == 0)
        if needed + evictable_hits > self.pool.num_free:
            return False
        self.pool.touch(cached_blocks)
        hosts = [self.tier.take(key) for key in tier_keys] if self.tier is not None else []
        evicted: list[tuple[int, BlockKey, int]] = []
        fresh = self.pool.allocate(max(needed, 0), evicted if self.tier is not None else None)
        self._offload(evicted)
        self.tier_in.extend(zip(hosts, fresh))
        table = table + cached_blocks + fresh
        self.tables[request_id] = table
        if self.enable_prefix_caching:
            self._register_full_blocks(request_id, token_ids, min(num_computed + num_new, len(token_ids)), root)
        return True

    def _offload(self, evicted: list[tuple[int, BlockKey, int]]) -> None:
        """Order the copy of each evicted cached block to the host tier (before this step's forward)."""
        for block_id, key, owner in evicted:
            order = self.tier.offload(block_id, key, owner) if self.tier is not None else None
            if order is not None:
                self.tier_out.append(order)
            if self.disk is not None:
                self.disk.store(block_id, hash_block_tokens(*key), owner)

    def take_tier_orders(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's tier copies (out, in), handed to the runner once; the tier's host blocks taken
        back become reusable from the next step."""
        out, into = self.tier_out, self.tier_in
        self.tier_out, self.tier_in = [], []
        if self.tier is not None:
            self.tier.end_step()
        return out, into

    def flush_to_disk(self) -> DiskOrders:
        """Orders writing the cached device blocks the disk tier lacks (at shutdown: a restart of the
        same model finds them), most recently used first (blocks requests hold, then the free queue
        from its newest end), at most the tier's capacity, with this step's other disk orders."""
        if self.disk is None:
            return DiskOrders()
        held = [b.block_id for b in self.pool.blocks if b.key is not None and b.ref_cnt > 0]
        free = [b for b in reversed(self.pool.free_queue) if self.pool.blocks[b].key is not None]
        for block_id in (held + free)[:self.disk.capacity]:
            block = self.pool.blocks[block_id]
            self.disk.store(block_id, hash_block_tokens(*block.key), block.owner)  # type: ignore[misc]
        return self.take_disk_orders()._replace(flush=True)

    def take_disk_orders(self) -> DiskOrders:
        """This step's disk-tier file work, handed to the runner once (reads stay pending until settle_disk)."""
        if self.disk is None:
            return DiskOrders()
        writes, deletes = self.disk.take_orders()
        reads, self._disk_read_orders = tuple(self._disk_read_orders), []
        return DiskOrders(writes, reads, deletes)

    def _register_full_blocks(self, request_id: str, token_ids: list[int], num_tokens: int, root: int) -> None:
        """Register blocks that are full after this step (their K/V is written before any reuse)."""
        hashes = self._hashed.setdefault(request_id, [])
        table = self.tables[request_id]
        for i in range(len(hashes), num_tokens // self.block_size):
            parent = hashes[-1] if hashes else root
            key = (parent, tuple(token_ids[i * self.block_size:(i + 1) * self.block_size]))
            self.pool.register(table[i], key, root)
            hashes.append(hash_block_tokens(*key))

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Give back the blocks past those `num_tokens` tokens need (the slots of rejected draft
        tokens). Registered blocks are full blocks of accepted tokens, so they are never past."""
        table = self.tables.get(request_id)
        keep = self.blocks_needed(num_tokens)
        if table is None or len(table) <= keep:
            return
        if len(self._hashed.get(request_id, ())) > keep:
            raise AssertionError(f"{request_id}: trimming a registered block")
        self.pool.release(table[keep:])
        self.tables[request_id] = table[:keep]

    def free(self, request_id: str) -> None:
        """Return all of a request's blocks (cached ones stay findable until evicted)."""
        self.pool.release(self.tables.pop(request_id, []))
        self._hashed.pop(request_id, None)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no request holds."""
        for key, block_id in list(self.pool.cached.items()):
            if self.pool.blocks[block_id].ref_cnt == 0:
                del self.pool.cached[key]
                self.pool.blocks[block_id].key = None

    def check_invariants(self) -> None:
        """Raise AssertionError if the accounting is inconsistent (tests call this after every op)."""
        refs = [0] * self.num_blocks
        for request_id, table in self.tables.items():
            if len(set(table)) != len(table):
                raise AssertionError(f"request {request_id} holds a block twice: {table}")
            for b in table:
                refs[b] += 1
        for block in self.pool.blocks:
            if block.ref_cnt != refs[block.block_id]:
                raise AssertionError(f"block {block.block_id}: ref_cnt {block.ref_cnt} != {refs[block.block_id]} uses")
            if (block.ref_cnt == 0) != (block.block_id in self.pool.free_queue):
                raise AssertionError(f"block {block.block_id}: free-queue membership disagrees with ref_cnt")
            if block.key is not None and self.pool.cached.get(block.key) != block.block_id:
                raise AssertionError(f"block {block.block_id}: key not mapped back to it")
        for key, block_id in self.pool.cached.items():
            if self.pool.blocks[block_id].key != key:
                raise AssertionError(f"cache entry for block {block_id} has a stale key")
        if self.tier is not None:
            self.tier.check_invariants()
        if self.disk is not None:
            self.disk.check_invariants()
