"""What one busy background process does to decode steps, by its CPU priority: the engine decodes
4 greedy streams (SmolLM2, float32, eager) while a pure-Python busy loop runs beside it at nice 0,
+10, +19 or SCHED_IDLE (a grammar compile or the decode-graph compile is such a process). Prints
each step-time distribution next to the undisturbed one, in alternating rounds, with the CPU (lscpu
flags). The hog is the point, so the foreign-CPU check is not applied; run it on an otherwise idle
machine.

    .venv/bin/python bench/background_priority.py [--rounds 3] [--tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.anchors.cpu import describe_cpu  # noqa: E402
from ferrylm import LLM, SamplingParams  # noqa: E402

HOG = [sys.executable, "-c", "while True: pass"]
PRIORITIES = {"none": None, "nice 0": [], "nice +10": ["nice", "-n", "10"], "nice +19": ["nice", "-n", "19"],
              "SCHED_IDLE": ["chrt", "-i", "0"]}


def steps_beside(engine, prefix: list[str] | None, tokens: int, tag: str) -> list[float]:
    """Step times (ms) of 4 streams decoding `tokens` tokens each, a hog at `prefix` running (None: no hog)."""
    hog = subprocess.Popen(prefix + HOG) if prefix is not None else None
    try:
        time.sleep(0.3)
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        for i in range(4):
            engine.add_request(f"{tag}-{i}", f"Describe a harbour at dawn. {i}", params)
        times = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - start) * 1000)
        return times[2:]  # the prefill steps are not decode steps
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    llm = LLM("smollm2-135m", dtype="float32", enforce_eager=True, max_num_seqs=16, max_num_batched_tokens=256)
    steps_beside(llm.engine, None, 8, "warm")
    times: dict[str, list[float]] = {name: [] for name in PRIORITIES}
    for r in range(args.rounds):
        for name, prefix in PRIORITIES.items():
            times[name] += steps_beside(llm.engine, prefix, args.tokens, f"{r}-{name}")
    print(f"CPU: {describe_cpu()}")
    print(f"4 streams x {args.tokens} tokens, {args.rounds} alternating rounds; decode step time (ms)\n")
    print("| busy process beside the engine | median | p90 | p99 | p99 / undisturbed p99 |\n|---|---:|---:|---:|---:|")
    base = statistics.quantiles(times["none"], n=100)[98]
    for name, values in times.items():
        q = statistics.quantiles(values, n=100)
        print(f"| {name} | {statistics.median(values):.1f} | {q[89]:.1f} | {q[98]:.1f} | {q[98] / base:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
