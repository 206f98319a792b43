"""Decode speed when the model was loaded on a thread that lives on vs one that ended (OpenMP pools).

libgomp keeps an OpenMP pool for every thread that ran a parallel region until that thread exits;
with more pooled threads than CPUs it stops spinning at barriers. `ferrylm serve` loaded the model on
asyncio.to_thread's worker (it lives on), then decoded on its engine thread: two pools. Each case
runs in a fresh interpreter: the default model (offline LLM, compiled decode step) is built on
- `pooled`: a ThreadPoolExecutor's worker that stays alive (what asyncio.to_thread did), or
- `short-lived`: run_in_short_lived_thread (what the server does now),
then another thread (the engine's) decodes `rows` sequences greedily. Printed per case: ms per decode
step and voluntary context switches per step of the whole process. Cases alternate, `--repeats` each.

    .venv/bin/python bench/openmp_teams.py [--rows 4] [--tokens 96] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu_check import ForeignCpu  # noqa: E402

CASE = r"""
import asyncio, concurrent.futures, json, os, sys, threading, time
from ferrylm import LLM, SamplingParams
from ferrylm.engine.short_lived_thread import run_in_short_lived_thread
from tests.proc_switches import voluntary_switches

case, rows, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
build = lambda: LLM("smollm2-135m", max_num_seqs=16, seed=0, enable_prefix_caching=False)
if case == "pooled":
    pool = concurrent.futures.ThreadPoolExecutor(1)  # kept: its worker lives on, as asyncio's do
    llm = pool.submit(build).result()
else:
    llm = asyncio.run(run_in_short_lived_thread(build))


result = {}
def engine():
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(1000 + i, 1016 + i))} for i in range(rows)]
    llm.generate(prompts[:1], [SamplingParams(max_tokens=4)], use_tqdm=False)  # starts the background compile
    llm.engine.executor.wait_compiled()
    llm.generate(prompts, [params] * rows, use_tqdm=False)  # warm-up on the compiled step
    before, start = voluntary_switches(), time.perf_counter()
    llm.generate(prompts, [params] * rows, use_tqdm=False)
    result.update(ms=(time.perf_counter() - start) * 1e3 / tokens, switches=(voluntary_switches() - before) / tokens)
t = threading.Thread(target=engine)
t.start()
t.join()
print(json.dumps(result))
"""


def flags() -> str:
    shown = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile")
    text = Path("/proc/cpuinfo").read_text()
    have = set(next(line for line in text.splitlines() if line.startswith("flags")).split(":")[1].split())
    model = next(line for line in text.splitlines() if line.startswith("model name")).split(":")[1].strip()
    return f"{model}, {os.cpu_count()} CPUs, flags: {' '.join(f for f in shown if f in have)}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    print(flags())
    results: dict[str, list[dict]] = {"pooled": [], "short-lived": []}
    for _ in range(args.repeats):
        for case in results:
            with ForeignCpu(children=True) as cpu:
                out = subprocess.run([sys.executable, "-c", CASE, case, str(args.rows), str(args.tokens)],
                                     capture_output=True, text=True, check=True, cwd=Path(__file__).parents[1])
            results[case].append(json.loads(out.stdout.strip().splitlines()[-1]) | {"foreign": cpu.share})
    print(f"\n{args.rows} rows x {args.tokens} tokens, compiled decode step, greedy\n")
    print("| model loaded on | ms per decode step (each run) | voluntary context switches per step | foreign CPU |")
    print("|---|---|---|---|")
    for case, runs in results.items():
        ms = " / ".join(f"{r['ms']:.1f}" for r in runs)
        switches = " / ".join(f"{r['switches']:.0f}" for r in runs)
        print(f"| {case} | {ms} | {switches} | {max(r['foreign'] for r in runs):.3f} |")


if __name__ == "__main__":
    main()
