"""Swap or recompute: which way a request preempted for KV blocks loses them (--preemption-mode).

Recompute drops the blocks and re-prefills the request's context when it resumes; swap copies the
blocks to host memory (--swap-space) and back. In `auto` each victim goes the cheaper way by the
cost model below, both sides estimated in seconds of engine time.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SwapCostModel:
    """Seconds to recompute n tokens vs. to copy their blocks out and back.

    The defaults were measured on the development machine (2 shared cores, AVX-512 + BF16, torch CPU)
    with bench/swap_cost.py on the default model (SmolLM2-135M, bf16, 16-token blocks of 368,640
    bytes of K/V over 30 layers), through the real prefill and the runner's real copy path
    (model/kv_swap.py), best of 3-5 runs, twice:
      prefill of one 64 / 256 / 512-token prompt: 33 / 84 / 133 ms (1,900 / 3,070 / 3,850 tokens/s);
      swap out + in of 4 / 16 / 32 blocks: 2.1 / 4.2 / 7.1 ms, one block 0.84 ms; a line through
      these is ~0.18 ms per block (2 x 368,640 bytes: ~4 GB/s) plus ~0.4 ms fixed per direction
      (an index_select + index_copy_ on each of 60 tensors).
    So recompute costs ~330 us a token and swap ~12 us a token past ~0.8 ms: `auto` swaps any victim
    with more than ~3 computed tokens here. On a GPU the copy crosses PCIe (~25 GB/s pinned) and
    prefill is far faster, so the balance differs: the constants are per machine and model, and a
    deployment can pass its own SwapCostModel to PreemptionPolicy.
    """

    prefill_tokens_per_s: float = 3000.0
    copy_bytes_per_s: float = 4.0e9
    copy_overhead_s: float = 0.4e-3  # each direction, whatever the block count

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s

    def swap_seconds(self, num_blocks: int, bytes_per_block: int) -> float:
        """Out and back in: two copies of every block, two fixed costs."""
        return 2 * (self.copy_overhead_s + num_blocks * bytes_per_block / self.copy_bytes_per_s)

    def prefers_swap(self, num_tokens: int, num_blocks: int, bytes_per_block: int) -> bool:
        return self.swap_seconds(num_blocks, bytes_per_block) < self.recompute_seconds(num_tokens)


class PreemptionPolicy:
    """The per-victim decision: `mode` "recompute" never swaps, "swap" always wants to (the scheduler
    recomputes when the host pool is full, counted as a fallback), "auto" asks the cost model.
    `bytes_per_block`: the host bytes one block's copy moves (the runner's swap_bytes_per_block)."""

    def __init__(self, mode: str = "auto", bytes_per_block: int = 0, cost: SwapCostModel | None = None):
        if mode not in ("auto", "recompute", "swap"):
            raise ValueError(f"unknown preemption mode {mode!r}")
        self.mode = mode
        self.bytes_per_block = bytes_per_block
        self.cost = cost if cost is not None else SwapCostModel()

    def wants_swap(self, num_tokens: int, num_blocks: int) -> bool:
        """Whether a victim with `num_tokens` computed tokens in `num_blocks` blocks should swap."""
        if self.mode != "auto":
            return self.mode == "swap"
        return self.cost.prefers_swap(num_tokens, num_blocks, self.bytes_per_block)
