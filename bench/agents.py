"""Agent turns against a small KV pool, with and without the prefix cache's host tier
(--kv-offload-cpu-gib): S sessions take T turns each, round-robin (the other sessions' turns are a
session's "think time": they evict its prefix from the device pool); each turn appends a tool result
to the session's context and asks for the next step. TTFT of a turn = the time to process its
prompt and produce one token, measured alone. Prints TTFT p50/p90 of turn 1 and of turns >= 2 per
side, the tier's hit share, the CPU (lscpu flags) and the CPU share anything else used (/proc/stat).

    .venv/bin/python bench/agents.py [--sessions 8] [--turns 4] [--context 1500] [--pool-tokens 3072]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.anchors.cpu import describe_cpu  # noqa: E402
from bench.cpu_check import ForeignCpu  # noqa: E402
from ferrylm import LLM, SamplingParams  # noqa: E402

BLOCK = 16


def workload(vocab: int, sessions: int, turns: int, context: int, tool: int, seed: int = 0) -> list[list[list[int]]]:
    """Per session, the prompt of each turn: a context of `context` tokens, then `tool` tokens more
    (a tool result) per turn."""
    rng = random.Random(seed)
    out = []
    for _ in range(sessions):
        ids = [rng.randrange(100, vocab) for _ in range(context)]
        prompts = []
        for _ in range(turns):
            prompts.append(list(ids))
            ids += [rng.randrange(100, vocab) for _ in range(tool)]
        out.append(prompts)
    return out


def run(llm: LLM, sessions: list[list[list[int]]]) -> tuple[list[float], list[float], float]:
    """TTFT of turn 1 and of later turns, round-robin over the sessions; foreign CPU share."""
    params = SamplingParams(temperature=0.0, max_tokens=1)
    first, later = [], []
    with ForeignCpu() as cpu:
        for turn in range(len(sessions[0])):
            for prompts in sessions:
                start = time.perf_counter()
                llm.generate([{"prompt_token_ids": prompts[turn]}], params, use_tqdm=False)
                (first if turn == 0 else later).append(time.perf_counter() - start)
    return first, later, cpu.share


def p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--context", type=int, default=1500, help="tokens of a session's first prompt")
    ap.add_argument("--tool", type=int, default=200, help="tokens a turn appends (a tool result)")
    ap.add_argument("--pool-tokens", type=int, default=3072, help="the device KV pool (--num-gpu-blocks-override)")
    ap.add_argument("--tier-gib", type=float, default=2.0)
    args = ap.parse_args()
    common = dict(num_gpu_blocks_override=args.pool_tokens // BLOCK, block_size=BLOCK, max_num_seqs=4,
                  max_num_batched_tokens=2048, max_model_len=8192)
    sides = {"host tier": LLM("smollm2-135m", kv_offload_cpu_gib=args.tier_gib, **common),
             "device pool only": LLM("smollm2-135m", **common)}
    vocab = sides["host tier"].engine.vocab_size
    sessions = workload(vocab, args.sessions, args.turns, args.context, args.tool)
    total = sum(len(s[-1]) for s in sessions)
    results = {}
    for llm in sides.values():  # the decode graphs compile in a child process: not while timing
        llm.engine.executor.wait_compiled()  # type: ignore[attr-defined]
    for name, llm in sides.items():
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2), use_tqdm=False)  # warm
        results[name] = run(llm, sessions)
    tier = sides["host tier"].engine.stats()
    print(f"CPU: {describe_cpu()}")
    print(f"{args.sessions} sessions x {args.turns} turns, context {args.context} + {args.tool} tokens a turn "
          f"(last turn {args.context + (args.turns - 1) * args.tool}); all contexts {total} tokens = "
          f"{total / args.pool_tokens:.1f}x the device pool ({args.pool_tokens} tokens); SmolLM2-135M, default dtype")
    print("| side | TTFT turn 1 p50 | TTFT turns >= 2 p50 | p90 | foreign CPU |\n|---|---:|---:|---:|---:|")
    for name, (first, later, share) in results.items():
        print(f"| {name} | {p(first, 50) * 1000:.0f} ms | {p(later, 50) * 1000:.0f} ms | "
              f"{p(later, 90) * 1000:.0f} ms | {share:.3f} |")
    ratio = p(results["device pool only"][1], 50) / p(results["host tier"][1], 50)
    print(f"turns >= 2: TTFT p50 {ratio:.2f}x lower with the host tier; tier: {tier.kv_offload_hit_tokens} "
          f"prompt tokens loaded back of {tier.prefix_cache_hits} cached ({tier.prefix_cache_queries} looked up), "
          f"{tier.kv_offload_blocks_out} blocks out, {tier.kv_offload_blocks_in} in")
    return 0


if __name__ == "__main__":
    sys.exit(main())
