"""Host (CPU) block pool for swap preemption: which host block holds which swapped-out request's KV.

Ids only, like BlockManager: the runner owns the host tensors (model/kv_swap.py) and copies blocks
when SchedulerOutput tells it to. A swapped request owns its host blocks privately (no prefix
sharing on the host side), so there are no ref counts: a block is free or owned by one request.
"""

from __future__ import annotations


class HostBlockPool:
    """`num_blocks` host blocks; `allocate` all-or-nothing per request, `free` returns them."""

    def __init__(self, num_blocks: int):
        if num_blocks < 0:
            raise ValueError("the host pool cannot have a negative number of blocks")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, request_id: str, n: int) -> list[int] | None:
        """n host blocks for `request_id` (which must hold none), or None (no change) if too few are free."""
        if request_id in self.tables:
            raise ValueError(f"request {request_id!r} already holds host blocks")
        if n > len(self._free):
            return None
        blocks = [self._free.pop() for _ in range(n)]
        self.tables[request_id] = blocks
        return blocks

    def block_table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    def free(self, request_id: str) -> list[int]:
        """Give back a request's host blocks (none held: a no-op); returns them, in table order."""
        blocks = self.tables.pop(request_id, [])
        self._free.extend(reversed(blocks))
        return blocks

    def check_invariants(self, owners: set[str] | None = None) -> None:
        """Every block free or owned by exactly one request; with `owners`, exactly those requests
        (the scheduler's swapped ones) hold host blocks."""
        seen = [0] * self.num_blocks
        for block_id in self._free:
            seen[block_id] += 1
        for table in self.tables.values():
            for block_id in table:
                seen[block_id] += 1
        bad = [b for b, n in enumerate(seen) if n != 1]
        if bad:
            raise AssertionError(f"host blocks {bad[:8]} are free and/or owned {[seen[b] for b in bad[:8]]} times")
        if owners is not None and set(self.tables) != owners:
            raise AssertionError(f"host blocks held by {sorted(self.tables)}, swapped requests are {sorted(owners)}")
