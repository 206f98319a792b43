"""Measure the two sides of the swap-vs-recompute cost model (engine/preemption.py) on this machine:
prefill tokens/s of the default model, and the swap copy's bytes/s (device → host → device) for its
blocks, through the runner's real copy path (model/kv_swap.py). Prints the numbers to paste there.

    .venv/bin/python bench/swap_cost.py [--model smollm2-135m] [--tokens 128 512]
"""

from __future__ import annotations

import argparse
import time

from ferrylm import LLM, SamplingParams


def _prefill_seconds(llm: LLM, n: int, repeat: int = 3) -> float:
    ids = [(i * 7919) % 20000 + 100 for i in range(n)]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    best = float("inf")
    for r in range(repeat):
        llm.engine.block_manager.reset_prefix_cache()
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": [ids[0] + r] + ids[1:]}], params, use_tqdm=False)
        best = min(best, time.perf_counter() - t0)
    return best


def _copy_seconds(llm: LLM, num_blocks: int, repeat: int = 5) -> float:
    swap = llm.engine.executor.kv_swap
    pairs = [(i, i) for i in range(num_blocks)]
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        swap.swap_out(pairs)
        swap.swap_in(pairs)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 512])
    args = ap.parse_args()
    llm = LLM(args.model, max_num_batched_tokens=max(args.tokens), swap_space=1.0)
    runner = llm.engine.executor
    per_block = runner.swap_bytes_per_block
    print(f"dtype {runner.dtype}, {per_block} bytes per block ({runner.block_size} tokens)")
    _prefill_seconds(llm, 32)  # warm-up
    for n in args.tokens:
        t = _prefill_seconds(llm, n)
        blocks = -(-n // runner.block_size)
        c = _copy_seconds(llm, blocks)
        print(f"{n:5d} tokens: prefill {t * 1e3:7.1f} ms ({n / t:7.0f} tok/s); swap out+in of {blocks} blocks "
              f"{c * 1e3:6.2f} ms ({2 * blocks * per_block / c / 1e9:5.2f} GB/s)")
    c1 = _copy_seconds(llm, 1, repeat=20)
    print(f"one block out+in: {c1 * 1e3:.2f} ms (the fixed cost per swap)")


if __name__ == "__main__":
    main()
