"""What a prefill chunk adds to the decode step it joins: 4 sequences decoding, plus one more request's
chunk of k prompt tokens (scored or not), timed at the runner with the default model and configuration
(compiled decode graphs loaded). Side by side in the same process, alternating: the chunk as one
decode row per token through the compiled step (what the runner does when the step's tokens fit its
graphs) and the eager mixed step (what it did before; forced here).

    .venv/bin/python bench/mixed_step.py [--chunks 8,16,32,60] [--repeats 7]

Prints ms per step (median) and the ratio to the 4-decode step; /proc/stat's foreign CPU share.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.anchors.cpu import describe_cpu  # noqa: E402
from bench.cpu_check import ForeignCpu  # noqa: E402
from ferrylm.config import EngineConfig  # noqa: E402
from ferrylm.model.parallel.tp_worker import build_runner  # noqa: E402
from ferrylm.sampling_params import SamplingParams  # noqa: E402
from ferrylm.scheduler_output import NewRequestData, ScheduledRequest, SchedulerOutput  # noqa: E402

DECODES, CONTEXT, BLOCKS_PER_SEQ = 4, 200, 32


def steps(runner, chunk: int, scored: bool, tag: str) -> tuple[SchedulerOutput, list[SchedulerOutput]]:
    """(the setup step prefilling the decoders, then the timed steps: 4 decodes + a `chunk`-token chunk
    of a fresh request each time, so that no chunk is cached)."""
    gen = torch.Generator().manual_seed(chunk)
    greedy = SamplingParams(temperature=0.0, max_tokens=64)
    decoders = [(f"{tag}-d{i}", torch.randint(3, 40000, (CONTEXT,), generator=gen).tolist()) for i in range(DECODES)]
    table = {rid: list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ)) for i, (rid, _) in enumerate(decoders)}
    setup = SchedulerOutput([ScheduledRequest(rid, p, 0, table[rid], True) for rid, p in decoders],
                            [NewRequestData(rid, p, greedy) for rid, p in decoders], [], DECODES * CONTEXT)
    timed = []
    for j in range(8):
        rid = f"{tag}-c{j}"
        prompt = torch.randint(3, 40000, (chunk + 1,), generator=gen).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1 if scored else None)
        blocks = list(range((DECODES + j) * BLOCKS_PER_SEQ, (DECODES + j + 1) * BLOCKS_PER_SEQ))
        decode = [ScheduledRequest(d, [5], CONTEXT + j, table[d], True) for d, _ in decoders]
        if chunk:
            decode.append(ScheduledRequest(rid, prompt[:chunk], 0, blocks, False))
        new = [NewRequestData(rid, prompt, params)] if chunk else []
        timed.append(SchedulerOutput(decode, new, [], DECODES + chunk))
    return setup, timed


def time_steps(runner, chunk: int, scored: bool, as_rows: bool, tag: str) -> list[float]:
    runner._rows_fit_compiled = (lambda output: True) if as_rows else (lambda output: False)
    setup, timed = steps(runner, chunk, scored, tag)
    runner.execute(setup)
    out = []
    for step in timed:
        start = time.perf_counter()
        runner.execute(step)
        out.append((time.perf_counter() - start) * 1000)
    finished = [s.request_id for s in setup.scheduled] + [n.request_id for s in timed for n in s.new_requests]
    runner.execute(SchedulerOutput([], [], finished, 0))
    return out[1:]  # the first pays one-off costs (a new sampling state's first step)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", default="8,16,32,60")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    runner, _, _ = build_runner(EngineConfig(), compile_in_child=False)
    runner.wait_compiled()
    assert runner.compiled is not None, "no compiled step: nothing to compare"
    print(f"CPU: {describe_cpu()}")
    print(f"{DECODES} sequences decoding at context {CONTEXT}, plus one request's prefill chunk; ms per step (median)")
    print("| step | eager mixed step | one row per token, compiled | ratio | vs 4 decodes (compiled) | foreign CPU |")
    print("|---|---:|---:|---:|---:|---:|")
    base = None
    cases = [(0, False)] + [(int(k), s) for k in args.chunks.split(",") for s in (False, True)]
    for chunk, scored in cases:
        eager, rows = [], []
        with ForeignCpu() as cpu:
            for r in range(args.repeats):  # alternating, so drift hits both sides
                eager += time_steps(runner, chunk, scored, False, f"e{chunk}{scored}{r}")
                rows += time_steps(runner, chunk, scored, True, f"r{chunk}{scored}{r}")
        e, c = statistics.median(eager), statistics.median(rows)
        base = base or c
        name = f"{DECODES} decodes" + (f" + {chunk} tokens" + (" scored" if scored else "") if chunk else "")
        print(f"| {name} | {e:.1f} | {c:.1f} | {e / c:.2f}x | {c / base:.2f}x | {cpu.share:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
