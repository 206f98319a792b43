"""Grammar compile bombs against the engine: is the compile budget kept, and how much do other
requests' decode steps suffer while a tenant keeps sending schemas that compile for ~13 s?

    .venv/bin/python bench/compile_budget.py [--rounds 3] [--budget 2.0]

(1) Budget: time from submitting a bomb to its refusal, for budgets 0.5 / 1 / 2 s (goal: within 10%),
    with a ready worker, and for a second bomb sent as the first is refused (it takes the killed
    worker's replacement: forked in ~10 ms on Linux, grammar_fork_server.py; a process start of
    ~2-4 s elsewhere).
(2) Victim: 4 greedy sequences decode 48 tokens each, step by step in this process; rounds alternate
    quiet and under attack (a thread submitting a new bomb as soon as the last was refused). Reported:
    step latency (ITL) p50/p99 per kind and the ratio (goal: p99 <= 1.2x). Quiet rounds read /proc/stat:
    CPU used by anything else is reported (attack rounds are busy with our own compile workers).
Results: bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu_check import ForeignCpu  # noqa: E402
from ferrylm import LLM, SamplingParams  # noqa: E402
from ferrylm.model.structured.structured_output import GrammarLimits  # noqa: E402
from ferrylm.sampling_params import StructuredOutputsParams  # noqa: E402

PROMPTS = ["The history of ferries", "A recipe for bread", "How rivers form", "The best way to learn"]


def bomb(i: int) -> StructuredOutputsParams:
    """~13 s of compiling on this machine (120 string patterns), unique per i (no cache hit)."""
    pattern = {"type": "string", "pattern": "^[a-z]{2,9}@[a-z]{3,9}\\.com$"}
    return StructuredOutputsParams(json={"title": f"bomb {i}", "type": "object",
                                         "properties": {f"p{k}": pattern for k in range(120)}})


def refusal_seconds(grammars, budget: float, i: int) -> float:
    grammars.limits = GrammarLimits(compile_timeout_s=budget, compile_memory_bytes=0)  # the time budget alone
    started = time.perf_counter()
    try:
        grammars.submit(bomb(i)).result(120)
    except ValueError:
        return time.perf_counter() - started
    raise RuntimeError("the bomb compiled within the budget: make it bigger")


def wait_for_spare(grammars, timeout: float = 120) -> None:
    """Until a killed worker's replacement is ready (GrammarCompiler starts one in the background)."""
    deadline = time.monotonic() + timeout
    while not grammars._idle and time.monotonic() < deadline:
        time.sleep(0.1)


def step_latencies(llm: LLM, tag: str) -> list[float]:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    for j, prompt in enumerate(PROMPTS):
        engine.add_request(f"{tag}-{j}", prompt, params)
    times, last = [], time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return times[len(PROMPTS):]  # decode steps only (the first steps prefill)


def attack(grammars, stop: threading.Event, budget: float, counter: list[int]) -> None:
    while not stop.is_set():
        counter[0] += 1
        try:
            grammars.limits = GrammarLimits(compile_timeout_s=budget, compile_memory_bytes=0)
            grammars.submit(bomb(10_000 + counter[0])).result(120)
        except ValueError:
            pass


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", type=float, default=2.0)
    args = ap.parse_args()
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    print(next((line for line in flags.splitlines() if line.startswith("Model name")), "?"))
    llm = LLM("smollm2-135m", enforce_eager=True, max_num_seqs=8)
    grammars = llm.engine.grammars
    grammars.submit(StructuredOutputsParams(regex="a")).result(120)  # the worker is up
    print("\n| budget (s) | refused after (s), a spare worker ready | ratio | refused after (s), right after "
          "the last refusal | ratio |\n|---|---|---|---|---|")
    for i, budget in enumerate((0.5, 1.0, 2.0)):
        wait_for_spare(grammars)
        ready = refusal_seconds(grammars, budget, 10 * i)
        queued = refusal_seconds(grammars, budget, 10 * i + 1)  # behind the killed worker's replacement
        print(f"| {budget} | {ready:.2f} | {ready / budget:.2f} | {queued:.2f} | {queued / budget:.2f} |")
    quiet: list[float] = []
    loud: list[float] = []
    shares = []
    step_latencies(llm, "warm")
    for r in range(args.rounds):
        with ForeignCpu() as cpu:
            quiet += step_latencies(llm, f"q{r}")
        shares.append(cpu.share)
        stop, counter = threading.Event(), [0]
        thread = threading.Thread(target=attack, args=(grammars, stop, args.budget, counter), daemon=True)
        thread.start()
        time.sleep(0.5)  # a bomb is compiling
        loud += step_latencies(llm, f"a{r}")
        stop.set()
        thread.join(30)
        print(f"round {r}: {counter[0]} bombs during the attack; foreign CPU in the quiet round {cpu.share:.1%}")
    print("\n| steps | ITL p50 (ms) | ITL p99 (ms) |\n|---|---|---|")
    for name, values in (("quiet", quiet), ("under compile bombs", loud)):
        print(f"| {name} | {statistics.median(values) * 1e3:.1f} | {pct(values, 99) * 1e3:.1f} |")
    print(f"\nITL p99 ratio under attack: {pct(loud, 99) / pct(quiet, 99):.2f}x "
          f"(p50 {statistics.median(loud) / statistics.median(quiet):.2f}x); max foreign CPU {max(shares):.1%}")
    llm.shutdown()


if __name__ == "__main__":
    main()
