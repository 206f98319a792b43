"""Offline throughput/latency benchmark: FerryLM's LLM vs transformers generate(), same run, same prompts.

Workloads (SmolLM2-135M): (a) mixed batch, (b) single-stream decode, (c) time to first token for a
500-token prompt, (d) shared 1,000-token system prompt with prefix caching on vs off, (e) pure decode
with 64 running sequences. Prints a table; `--json` writes the figures.

    .venv/bin/python bench/offline.py            # everything, ~10 minutes on 2 cores
    .venv/bin/python bench/offline.py --only b,c # a subset
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ferrylm import LLM, SamplingParams  # noqa: E402
from ferrylm.model.loaders.model_source import resolve_model  # noqa: E402

CORPUS = Path(__file__).with_name("corpus.txt")


def corpus_tokens(tokenizer) -> list[int]:
    text = CORPUS.read_text() if CORPUS.exists() else " ".join(f"word{i} and more text {i * 7}" for i in range(3000))
    ids = tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < 4000:
        ids = ids + ids
    return ids


def make_prompts(tokens: list[int], lengths: list[int], rng: random.Random) -> list[list[int]]:
    out = []
    for n in lengths:
        start = rng.randrange(0, len(tokens) - n)
        out.append(tokens[start:start + n])
    return out


class HFBaseline:
    """transformers generate() with static left-padded batches: the baseline users would try first."""

    def __init__(self, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        source = resolve_model("smollm2-135m")
        start = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(str(source.directory), gguf_file=source.path.name,
                                                          dtype=dtype).eval()
        self.load_seconds = time.perf_counter() - start

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new: list[int], batch_size: int) -> tuple[int, float]:
        """Returns (output tokens counted as requested, seconds)."""
        start, total = time.perf_counter(), 0
        for i in range(0, len(prompts), batch_size):
            chunk, news = prompts[i:i + batch_size], max_new[i:i + batch_size]
            width = max(map(len, chunk))
            ids = torch.tensor([[2] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(news), min_new_tokens=max(news),
                                do_sample=False, pad_token_id=2)
            total += sum(news)  # useful tokens: a static batch runs until its longest request ends
        return total, time.perf_counter() - start


def run_llm(llm: LLM, prompts: list[list[int]], max_new: list[int]) -> tuple[int, float, list]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_new]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs), elapsed, outs


def ttft(llm: LLM, prompt: list[int]) -> float:
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    return time.perf_counter() - start


def workload_a(llm, hf, tokens, rng, args, rows):
    lengths = [rng.randint(32, 512) for _ in range(64)]
    news = [rng.randint(32, 256) for _ in range(64)]
    prompts = make_prompts(tokens, lengths, rng)
    n, dt, _ = run_llm(llm, prompts, news)
    row = {"workload": "(a) 64 mixed requests", "ferrylm": f"{n / dt:.0f} out tok/s"}
    if hf:
        k = args.hf_requests
        hn, hdt = hf.generate(prompts[:k], news[:k], 16)
        row["baseline"] = f"transformers: {hn / hdt:.0f} out tok/s (first {k} requests, static batch 16)"
        row["ratio"] = f"{(n / dt) / (hn / hdt):.1f}x"
    rows.append(row)


def workload_b(llm, hf, tokens, rng, args, rows):
    prompt = make_prompts(tokens, [64], rng)
    run_llm(llm, prompt, [8])  # warm
    n, dt, _ = run_llm(llm, prompt, [128])
    row = {"workload": "(b) single stream, 128 tokens", "ferrylm": f"{n / dt:.1f} tok/s"}
    if hf:
        hn, hdt = hf.generate(prompt, [128], 1)
        row |= {"baseline": f"transformers: {hn / hdt:.1f} tok/s", "ratio": f"{(n / dt) / (hn / hdt):.1f}x"}
    rows.append(row)


def workload_c(llm, hf, tokens, rng, args, rows):
    prompt = make_prompts(tokens, [500], rng)[0]
    llm.engine.block_manager.reset_prefix_cache()
    t = min(ttft(llm, prompt) for _ in range(2) if not llm.engine.block_manager.reset_prefix_cache())
    row = {"workload": "(c) TTFT, 500-token prompt", "ferrylm": f"{t:.3f} s"}
    if hf:
        _, hdt = hf.generate([prompt], [1], 1)
        row |= {"baseline": f"transformers: {hdt:.3f} s", "ratio": f"{hdt / t:.1f}x faster"}
    rows.append(row)


def workload_d(llm, hf, tokens, rng, args, rows):
    system = make_prompts(tokens, [1000], rng)[0]
    questions = make_prompts(tokens, [rng.randint(10, 30) for _ in range(32)], rng)
    prompts = [system + q for q in questions]
    results = {}
    for enabled in (False, True):
        llm.engine.block_manager.enable_prefix_caching = enabled
        llm.engine.block_manager.reset_prefix_cache()
        before = llm.engine.stats()
        n, dt, _ = run_llm(llm, prompts, [16] * 32)
        after = llm.engine.stats()
        hits = after.prefix_cache_hits - before.prefix_cache_hits
        results[enabled] = (sum(map(len, prompts)) - hits, dt)
    llm.engine.block_manager.enable_prefix_caching = True
    (cold_tok, cold_t), (warm_tok, warm_t) = results[False], results[True]
    rows.append({"workload": "(d) 1000-token shared prefix x32",
                 "ferrylm": f"cache on: {warm_tok} prefill tok, {warm_t:.2f} s",
                 "baseline": f"cache off: {cold_tok} prefill tok, {cold_t:.2f} s",
                 "ratio": f"{cold_t / warm_t:.1f}x faster, {1 - warm_tok / cold_tok:.0%} prefill saved"})


def workload_e(llm, hf, tokens, rng, args, rows):
    prompts = make_prompts(tokens, [16] * 64, rng)
    n, dt, _ = run_llm(llm, prompts, [args.decode_tokens] * 64)
    rows.append({"workload": f"(e) pure decode, 64 seqs x {args.decode_tokens}", "ferrylm": f"{n / dt:.0f} tok/s"})


WORKLOADS = {"a": workload_a, "b": workload_b, "c": workload_c, "d": workload_d, "e": workload_e}


def print_table(rows: list[dict]) -> None:
    cols = ["workload", "ferrylm", "baseline", "ratio"]
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols]
    line = " | ".join(c.ljust(w) for c, w in zip(cols, widths))
    print(line)
    print("-|-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(str(r.get(c, "")).ljust(w) for c, w in zip(cols, widths)))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--only", default="a,b,c,d,e")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--hf-dtype", default="float32")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--hf-requests", type=int, default=16, help="requests of (a) run through transformers")
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--json", type=Path)
    p.add_argument("--enforce-eager", action="store_true", help="no compiled decode step (the default compiles it)")
    args = p.parse_args()
    rng = random.Random(0)
    t0 = time.perf_counter()
    llm = LLM("smollm2-135m", dtype=args.dtype, max_num_seqs=64, max_num_batched_tokens=1024,
              enforce_eager=args.enforce_eager)
    load_s = time.perf_counter() - t0
    print(f"load: {time.perf_counter() - t0:.1f} s, dtype {llm.engine.executor.dtype}, "
          f"threads {torch.get_num_threads()}", flush=True)
    hf = None if args.no_hf else HFBaseline(getattr(torch, args.hf_dtype))
    tokens = corpus_tokens(llm.get_tokenizer())
    rows: list[dict] = [{"workload": "model load (weights + tokenizer)", "ferrylm": f"{load_s:.1f} s"}]
    if hf:
        rows[0] |= {"baseline": f"transformers: {hf.load_seconds:.1f} s (weights only)"}
    for key in args.only.split(","):
        WORKLOADS[key](llm, hf, tokens, rng, args, rows)
        print(rows[-1], flush=True)
    print()
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
