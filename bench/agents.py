"""Agent turns against a small KV pool, with and without the prefix cache's tiers (host RAM,
--kv-offload-cpu-gib, and disk, --kv-offload-disk-path): S sessions take T turns each, round-robin
(the other sessions' turns are a session's "think time": they evict its prefix from the device pool);
each turn appends a tool result to the session's context and asks for the next step. TTFT of a turn =
the time to process its prompt and produce one token, measured alone. Prints TTFT p50/p90 of turn 1
and of turns >= 2 per side, each tier's hits, the CPU (lscpu flags) and the CPU share anything else
used (/proc/stat).

    .venv/bin/python bench/agents.py [--sessions 8] [--turns 4] [--context 1500] [--context-max N]
        [--tool 200] [--pool-tokens 3072] [--tier-gib 2] [--disk-gib 0] [--baseline-sessions N]

--disk-gib > 0 adds the disk tier (in a temporary directory) under the host tier. --baseline-sessions
runs the side without tiers on the first N sessions only (its turns >= 2 miss the pool all the same
as long as the other N-1 sessions' contexts exceed it; the script checks that), to keep it short.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.anchors.cpu import describe_cpu  # noqa: E402
from bench.cpu_check import ForeignCpu  # noqa: E402
from ferrylm import LLM, SamplingParams  # noqa: E402

BLOCK = 16


def workload(vocab: int, sessions: int, turns: int, context: int, tool: int, seed: int = 0,
             context_max: int | None = None) -> list[list[list[int]]]:
    """Per session, the prompt of each turn: a context of `context` (to `context_max`) tokens, then
    `tool` tokens more (a tool result) per turn."""
    rng = random.Random(seed)
    out = []
    for _ in range(sessions):
        ids = [rng.randrange(100, vocab) for _ in range(rng.randint(context, context_max or context))]
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
    ap.add_argument("--context", type=int, default=1500, help="tokens of a session's first prompt (at least)")
    ap.add_argument("--context-max", type=int, default=None, help="draw each session's first prompt up to this")
    ap.add_argument("--tool", type=int, default=200, help="tokens a turn appends (a tool result)")
    ap.add_argument("--pool-tokens", type=int, default=3072, help="the device KV pool (--num-gpu-blocks-override)")
    ap.add_argument("--tier-gib", type=float, default=2.0)
    ap.add_argument("--disk-gib", type=float, default=0.0, help="a disk tier under the host tier (0: none)")
    ap.add_argument("--baseline-sessions", type=int, default=None, help="sessions the side without tiers runs")
    args = ap.parse_args()
    common = dict(num_gpu_blocks_override=args.pool_tokens // BLOCK, block_size=BLOCK, max_num_seqs=4,
                  max_num_batched_tokens=2048, max_model_len=8192)
    disk_dir = tempfile.TemporaryDirectory(prefix="ferrylm-agents-disk-") if args.disk_gib else None
    tiers = dict(kv_offload_cpu_gib=args.tier_gib)
    if disk_dir is not None:
        tiers.update(kv_offload_disk_path=disk_dir.name, kv_offload_disk_gib=args.disk_gib)
    tiered_name = "host + disk tiers" if disk_dir is not None else "host tier"
    plan = {tiered_name: tiers, "device pool only": {}}
    results, stats = {}, {}
    vocab = None
    for name, extra in plan.items():
        llm = LLM("smollm2-135m", **common, **extra)
        vocab = vocab or llm.engine.vocab_size
        sessions = workload(vocab, args.sessions, args.turns, args.context, args.tool, context_max=args.context_max)
        if name == "device pool only" and args.baseline_sessions:
            sessions = sessions[:args.baseline_sessions]
            others = sorted(len(s[0]) for s in sessions)[:-1]
            assert sum(others) > args.pool_tokens, "the baseline's other sessions must overflow the pool"
        llm.engine.executor.wait_compiled()  # type: ignore[attr-defined]  # compiles in a child: not while timing
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2), use_tqdm=False)  # warm
        results[name] = run(llm, sessions)
        stats[name] = llm.engine.stats()
        llm.shutdown()
        del llm
    sessions = workload(vocab or 0, args.sessions, args.turns, args.context, args.tool, context_max=args.context_max)
    total = sum(len(s[-1]) for s in sessions)
    print(f"CPU: {describe_cpu()}")
    longest = args.context_max or args.context
    print(f"{args.sessions} sessions x {args.turns} turns, first prompt {args.context}-{longest} tokens"
          f" + {args.tool} a turn; all contexts {total} tokens = {total / args.pool_tokens:.1f}x the device "
          f"pool ({args.pool_tokens} tokens); host tier {args.tier_gib} GiB, disk tier {args.disk_gib} GiB; "
          f"baseline sessions {args.baseline_sessions or args.sessions}; SmolLM2-135M, default dtype")
    print("| side | TTFT turn 1 p50 | TTFT turns >= 2 p50 | p90 | turns | foreign CPU |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (first, later, share) in results.items():
        print(f"| {name} | {p(first, 50) * 1000:.0f} ms | {p(later, 50) * 1000:.0f} ms | "
              f"{p(later, 90) * 1000:.0f} ms | {len(first) + len(later)} | {share:.3f} |")
    ratio = p(results["device pool only"][1], 50) / p(results[tiered_name][1], 50)
    t = stats[tiered_name]
    device_hits = t.prefix_cache_hits - t.kv_offload_hit_tokens
    print(f"turns >= 2: TTFT p50 {ratio:.2f}x lower with the tiers")
    print(f"hits of {t.prefix_cache_queries} prompt tokens looked up: device pool {device_hits} "
          f"({device_hits / t.prefix_cache_queries:.1%}), host tier {t.kv_offload_hit_tokens} "
          f"({t.kv_offload_hit_tokens / t.prefix_cache_queries:.1%}; {t.kv_offload_disk_hit_tokens} of them read up "
          f"from disk, {t.kv_offload_disk_hit_tokens / t.prefix_cache_queries:.1%})")
    print(f"host tier: {t.kv_offload_blocks_out} blocks out, {t.kv_offload_blocks_in} in; disk tier: "
          f"{t.kv_offload_disk_blocks_written} files written ({t.kv_offload_disk_bytes_written / 2**30:.2f} GiB), "
          f"{t.kv_offload_disk_blocks_read} read ({t.kv_offload_disk_bytes_read / 2**30:.2f} GiB, "
          f"{1000 * t.kv_offload_disk_read_seconds / max(t.kv_offload_disk_blocks_read, 1):.2f} ms a block), "
          f"{t.kv_offload_disk_blocks_lost} lost")
    if disk_dir is not None:
        disk_dir.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
