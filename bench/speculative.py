"""Speculative decoding (n-gram prompt lookup): the same engine settings with and without drafts,
side by side in one process (alternating rounds), greedy, so both produce the same tokens.

    .venv/bin/python bench/speculative.py [--rounds 3] [--max-tokens 128] [--k 4]

Rows: single stream on an input-grounded workload (the answer quotes or edits text in the prompt)
and on open-ended chat (decode tok/s, first token to last); batches of 2..16 with drafts forced on
(the crossover behind the default disable_by_batch_size); 64 concurrent sequences with the default
settings (throughput). Acceptance rate and mean accepted length per workload. Each timed run reads
/proc/stat and reports the CPU share anything else used. Results: bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu_check import ForeignCpu  # noqa: E402
from ferrylm import LLM, SamplingParams  # noqa: E402
from ferrylm.config import SpeculativeConfig  # noqa: E402

CODE = '''def average(values):
    total = 0
    for v in values:
        total += v
    return total / len(values) + 1

def largest(values):
    best = values[0]
    for v in values:
        if v > best:
            best = v
    return best
'''
TABLE = "| city | country | population |\n| Paris | France | 2100000 |\n| Rome | Italy | 2800000 |\n" \
        "| Madrid | Spain | 3300000 |\n| Lisbon | Portugal | 550000 |\n| Vienna | Austria | 1900000 |"
TEXT = ("The harbour was quiet that morning. \"We sail at noon,\" said the captain, \"whatever the wind does.\" "
        "The crew loaded barrels of water, coils of rope and a crate of oranges. By eleven the clouds had "
        "lifted, and the gulls circled the mast as if they knew a voyage was beginning.")
GROUNDED = [f"Fix the bug in this code and return the whole corrected code:\n{CODE}",
            f"Reformat this table as CSV with a header line:\n{TABLE}",
            f"Summarize this passage, quoting the captain's words exactly:\n{TEXT}",
            f"Repeat the following passage word for word:\n{TEXT}"]
OPEN = ["Tell me a story about a lighthouse keeper.", "What should I cook for dinner tonight?",
        "Explain why the sky is blue.", "Write a short poem about autumn."]


def chat_ids(llm: LLM, questions: list[str]) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [tok.apply_chat_template([{"role": "user", "content": q}]) for q in questions]


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict:
    """One generate over `prompts` together: seconds, tokens, decode tok/s per stream, foreign CPU."""
    before = llm.engine.stats()
    with ForeignCpu() as cpu:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    after = llm.engine.stats()
    m = [o.metrics for o in outs]
    seconds = max(x.finished_time for x in m) - min(x.arrival_time for x in m)
    tokens = [len(o.outputs[0].token_ids) for o in outs]
    decode = [(n - 1) / (x.finished_time - x.first_token_time) for n, x in zip(tokens, m) if n > 1]
    drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
    drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    return {"seconds": seconds, "tokens": sum(tokens), "decode": statistics.mean(decode) if decode else 0.0,
            "foreign": cpu.share, "drafts": drafts, "drafted": drafted, "accepted": accepted,
            "ids": [o.outputs[0].token_ids for o in outs]}


def compare(name: str, plain: LLM, spec: LLM, prompts: list[list[int]], params: SamplingParams, rounds: int,
            one_at_a_time: bool) -> dict:
    """Alternating rounds; the median of each side. Single-stream rows run their prompts one by one."""
    sides: dict[str, list[dict]] = {"plain": [], "spec": []}
    for _ in range(rounds):
        for side, llm in (("plain", plain), ("spec", spec)):
            groups = [[p] for p in prompts] if one_at_a_time else [prompts]
            results = [run(llm, g, params) for g in groups]
            sides[side].append({
                "seconds": sum(r["seconds"] for r in results), "tokens": sum(r["tokens"] for r in results),
                "decode": statistics.mean(r["decode"] for r in results),
                "foreign": max(r["foreign"] for r in results), "drafts": sum(r["drafts"] for r in results),
                "drafted": sum(r["drafted"] for r in results), "accepted": sum(r["accepted"] for r in results),
                "ids": [i for r in results for i in r["ids"]]})
    same = all(a["ids"] == b["ids"] for a, b in zip(sides["plain"], sides["spec"]))

    def med(side: str, key: str) -> float:
        return statistics.median(r[key] for r in sides[side])

    spec_runs = sides["spec"]
    drafts, drafted, accepted = (sum(r[k] for r in spec_runs) for k in ("drafts", "drafted", "accepted"))
    key = "decode" if one_at_a_time else "throughput"
    for side in sides.values():
        for r in side:
            r["throughput"] = r["tokens"] / r["seconds"]
    row = {"name": name, "plain": med("plain", key), "spec": med("spec", key), "same_tokens": same,
           "acceptance": accepted / drafted if drafted else 0.0,
           "mean_accepted_length": 1 + accepted / drafts if drafts else 1.0,
           "foreign": max(r["foreign"] for s in sides.values() for r in s), "metric": key}
    row["ratio"] = row["spec"] / row["plain"] if row["plain"] else 0.0
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--batch-sizes", default="2,4,8,16")
    ap.add_argument("--enforce-eager", action="store_true")
    args = ap.parse_args()
    config = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4}
    common = dict(max_num_seqs=max(64, args.concurrency), max_num_batched_tokens=1024, enforce_eager=args.enforce_eager)
    plain = LLM(args.model, **common)
    spec = LLM(args.model, speculative_config=config, **common)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    grounded, open_ended = chat_ids(plain, GROUNDED), chat_ids(plain, OPEN)
    rows = [compare("single stream, input-grounded", plain, spec, grounded, params, args.rounds, True),
            compare("single stream, open-ended chat", plain, spec, open_ended, params, args.rounds, True)]
    forced = SpeculativeConfig.parse(config | {"disable_by_batch_size": 4096})
    default = spec.engine.executor.speculator.config if spec.engine.executor.speculator is not None else None
    spec.engine.executor.set_speculative(forced)
    for b in (int(x) for x in args.batch_sizes.split(",")):
        batch = (grounded * b)[:b]
        rows.append(compare(f"{b} concurrent, input-grounded, drafts forced on", plain, spec, batch, params,
                            args.rounds, False))
    spec.engine.executor.set_speculative(default)
    mixed = ((grounded + open_ended) * args.concurrency)[:args.concurrency]
    rows.append(compare(f"{args.concurrency} concurrent, mixed, default settings", plain, spec, mixed, params,
                        args.rounds, False))
    print(f"\nngram k={args.k}, greedy, max_tokens={args.max_tokens}, {args.rounds} alternating rounds (median)\n")
    print("| workload | metric | plain tok/s | ngram tok/s | ratio | acceptance | mean accepted length "
          "| same tokens | foreign CPU |")
    print("|---|---|---:|---:|---:|---:|---:|---|---:|")
    for r in rows:
        print(f"| {r['name']} | {r['metric']} | {r['plain']:.1f} | {r['spec']:.1f} | {r['ratio']:.2f}x "
              f"| {r['acceptance']:.0%} | {r['mean_accepted_length']:.2f} | {r['same_tokens']} | {r['foreign']:.1%} |")


if __name__ == "__main__":
    main()
