"""Tensor parallelism on CPU: TP=2 (gloo over loopback, 2 processes) vs TP=1, same model and settings,
in one run: decode step time at batch 1 and batch 16, and the share of rank 0's step spent in
collectives (all-reduce after o_proj and down in every layer, the embedding's all-reduce, the
logits' all-gather).

    .venv/bin/python bench/tensor_parallel.py [--dtype float32] [--max-tokens 64] [--rounds 2]

On this 2-core machine the two ranks share the cores that TP=1 uses alone (1 OpenMP thread each),
so TP=2 cannot be faster here: the point is the measured cost of the collectives. Each timed run
reads /proc/stat for CPU used by anything else (the TP=2 worker is ours: its share is reported as
part of the run, not as foreign). Results: bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu_check import ForeignCpu  # noqa: E402
from ferrylm import LLM, SamplingParams  # noqa: E402
from tests.model.prompts import SIXTEEN_PROMPTS  # noqa: E402


def timed(llm: LLM, prompts: list[dict], params: SamplingParams, exclude_pids: list[int]) -> dict:
    """Seconds per decode step (wall time of the generate / steps after prefill) and collective share."""
    runner = getattr(llm.engine.executor, "runner", llm.engine.executor)  # under TP: rank 0's runner
    group = runner.tp.group if runner.tp is not None else None
    coll0 = group.collective_seconds if group else 0.0
    steps = 0
    step = llm.engine.step

    def counting_step():
        nonlocal steps
        steps += 1
        return step()

    llm.engine.step = counting_step
    with ForeignCpu(exclude_pids=exclude_pids) as cpu:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
    del llm.engine.step
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    coll = (group.collective_seconds - coll0) if group else 0.0
    return {"step_ms": 1000 * seconds / steps, "tok_s": tokens / seconds, "coll": coll / seconds,
            "foreign": cpu.share}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    common = dict(dtype=args.dtype, enforce_eager=True, max_num_seqs=16, max_num_batched_tokens=1024)
    tp1 = LLM(args.model, quantization="none", **common)  # TP ranks hold float weights: compare like with like
    tp2 = LLM(args.model, tensor_parallel_size=2, **common)
    worker_pids = [p.pid for p in tp2.engine.executor.ranks.procs]
    tok = tp1.get_tokenizer()
    prompts = [{"prompt_token_ids": tok.apply_chat_template([{"role": "user", "content": q}])}
               for q in SIXTEEN_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for llm in (tp1, tp2):  # rank 1 loads its shard while rank 0's LLM() returns: wait for it here
        llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    rows = []
    for batch in (1, 16):
        runs: dict[str, list[dict]] = {"TP=1": [], "TP=2": []}
        for _ in range(args.rounds):
            runs["TP=1"].append(timed(tp1, prompts[:batch], params, []))
            runs["TP=2"].append(timed(tp2, prompts[:batch], params, worker_pids))
        for name, results in runs.items():
            rows.append((batch, name, statistics.median(r["step_ms"] for r in results),
                         statistics.median(r["tok_s"] for r in results),
                         statistics.median(r["coll"] for r in results), max(r["foreign"] for r in results)))
    tp2.shutdown()
    print(f"\n{args.model}, {args.dtype}, eager, max_tokens={args.max_tokens}, {args.rounds} alternating rounds "
          "(median)\n")
    print("| batch | engine | ms per step | tok/s | collectives share of wall time | foreign CPU |")
    print("|---:|---|---:|---:|---:|---:|")
    for batch, name, step_ms, tok_s, coll, foreign in rows:
        print(f"| {batch} | {name} | {step_ms:.1f} | {tok_s:.1f} | {coll:.0%} | {foreign:.1%} |")


if __name__ == "__main__":
    main()
