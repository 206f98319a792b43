"""Speculative decoding methods side by side: ngram, layer_skip (the target's first layers) and
draft_model (SmolLM2 cut to its first layers, written to a temp dir), each against plain decoding on
the same loaded model in the same run (alternating rounds, medians), single stream, greedy.

    .venv/bin/python bench/speculative_methods.py [--rounds 2] [--max-tokens 96] [--k 4]

Per method and workload: decode tok/s (first token to last) with and without drafts, the ratio,
acceptance rate and mean accepted length, whether the tokens were identical, and the CPU share
anything else used during the timed runs (/proc/stat). Results: bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.speculative import GROUNDED, OPEN, chat_ids, run  # noqa: E402
from ferrylm import LLM, SamplingParams  # noqa: E402
from ferrylm.config import SpeculativeConfig  # noqa: E402
from tests.model.draft_models import write_truncated  # noqa: E402


def single_stream(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Each prompt alone; mean decode tok/s and the summed draft counters."""
    results = [run(llm, [p], params) for p in prompts]
    return {"decode": statistics.mean(r["decode"] for r in results),
            "foreign": max(r["foreign"] for r in results),
            "drafts": sum(r["drafts"] for r in results), "drafted": sum(r["drafted"] for r in results),
            "accepted": sum(r["accepted"] for r in results), "ids": [i for r in results for i in r["ids"]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--skip-layers", default="20,26", help="layer_skip num_layers values")
    ap.add_argument("--draft-layers", default="8,16", help="draft_model: the target cut to these many layers")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ferrylm-drafts-"))
    methods = {"ngram": {"method": "ngram", "prompt_lookup_max": 4}}
    for n in (int(x) for x in args.skip_layers.split(",") if x):
        methods[f"layer_skip {n} layers"] = {"method": "layer_skip", "num_layers": n}
    for n in (int(x) for x in args.draft_layers.split(",") if x):
        path = write_truncated(args.model, n, tmp / f"draft{n}")
        methods[f"draft_model ({n}-layer cut)"] = {"method": "draft_model", "model": str(path)}
    llm = LLM(args.model, max_num_seqs=64, max_num_batched_tokens=1024)
    runner = llm.engine.executor
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    workloads = {"input-grounded": chat_ids(llm, GROUNDED), "open-ended chat": chat_ids(llm, OPEN)}
    rows = []
    for name, method in methods.items():
        config = SpeculativeConfig.parse(method | {"num_speculative_tokens": args.k})
        for workload, prompts in workloads.items():
            plain, spec = [], []
            for _ in range(args.rounds):
                runner.set_speculative(None)
                plain.append(single_stream(llm, prompts, params))
                runner.set_speculative(config)
                spec.append(single_stream(llm, prompts, params))
            runner.set_speculative(None)
            p_tps = statistics.median(r["decode"] for r in plain)
            s_tps = statistics.median(r["decode"] for r in spec)
            drafts, drafted, accepted = (sum(r[k] for r in spec) for k in ("drafts", "drafted", "accepted"))
            rows.append((name, workload, p_tps, s_tps, s_tps / p_tps, accepted / drafted if drafted else 0.0,
                         1 + accepted / drafts if drafts else 1.0,
                         all(a["ids"] == b["ids"] for a, b in zip(plain, spec)),
                         max(r["foreign"] for r in plain + spec)))
            print(rows[-1], flush=True)
    print(f"\nk={args.k}, greedy, max_tokens={args.max_tokens}, single stream, {args.rounds} alternating rounds "
          "(median)\n")
    print("| method | workload | plain tok/s | spec tok/s | ratio | acceptance | mean accepted length | same tokens "
          "| foreign CPU |")
    print("|---|---|---:|---:|---:|---:|---:|---|---:|")
    for name, workload, p, s, ratio, acc, mal, same, foreign in rows:
        print(f"| {name} | {workload} | {p:.1f} | {s:.1f} | {ratio:.2f}x | {acc:.0%} | {mal:.2f} | {same} "
              f"| {foreign:.1%} |")


if __name__ == "__main__":
    main()
