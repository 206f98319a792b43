"""Embeddings throughput: FerryLM's pooling path (the offline LLM with `pooling="last"`, as
`--runner pooling` serves it, default --dtype) against transformers on the same GGUF and the same batch (float32,
padded batch, last non-pad token's final hidden state, L2-normalised), alternating rounds in one
process. Prints sequences/s per side, their ratio, the largest difference between the two vectors
of a sequence, the CPU (lscpu flags) and the CPU share anything else used (/proc/stat).

    .venv/bin/python bench/embeddings.py [--batch 32] [--rounds 3]
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
from ferrylm import LLM, SamplingParams  # noqa: E402
from ferrylm.model.loaders.model_source import resolve_model  # noqa: E402

SENTENCES = ["The ferry leaves the harbour at dawn and crosses the fjord in forty minutes.",
             "Embeddings map a sentence to a vector whose direction carries its meaning.",
             "A long pier, a few gulls and a lighthouse that has not been lit for years.",
             "The engine's scheduler batches prompts so that every core stays busy.",
             "Bring a warm coat: the wind on the upper deck is cold even in summer."]


def transformers_side(model, batches: list[list[list[int]]]) -> list[torch.Tensor]:
    out = []
    with torch.inference_mode():
        for ids in batches:
            width = max(map(len, ids))
            input_ids = torch.tensor([p + [0] * (width - len(p)) for p in ids])
            mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in ids])
            hidden = model.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
            last = hidden[torch.arange(len(ids)), mask.sum(1) - 1]
            out += list(torch.nn.functional.normalize(last.float(), dim=-1))
    return out


def ferrylm_side(llm: LLM, batches: list[list[list[int]]]) -> list[torch.Tensor]:
    params = SamplingParams(max_tokens=0, pooling="last")
    out = []
    for ids in batches:
        results = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
        out += [torch.tensor(r.pooled) for r in results]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="auto", help="FerryLM's --dtype (auto: what serve picks on this CPU)")
    ap.add_argument("--quantization", default=None, help="FerryLM's --quantization (default: GGUF kept packed)")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    source = resolve_model("smollm2-135m")
    hf = AutoModelForCausalLM.from_pretrained(str(source.directory), gguf_file=source.path.name,
                                              dtype=torch.float32).eval()
    llm = LLM("smollm2-135m", dtype=args.dtype, quantization=args.quantization, enforce_eager=True,
              max_num_seqs=args.batch, max_num_batched_tokens=4096, enable_prefix_caching=False)
    tok = llm.get_tokenizer()
    texts = [f"{SENTENCES[i % len(SENTENCES)]} (item {i})" for i in range(args.batch * args.batches)]
    ids = [tok.encode(t) for t in texts]
    batches = [ids[i:i + args.batch] for i in range(0, len(ids), args.batch)]
    ferrylm_side(llm, batches[:1])  # warm both
    transformers_side(hf, batches[:1])
    rates: dict[str, list[float]] = {"ferrylm": [], "transformers": []}
    shares = []
    vectors = {}
    for _ in range(args.rounds):
        for name, run in (("ferrylm", lambda: ferrylm_side(llm, batches)),
                          ("transformers", lambda: transformers_side(hf, batches))):
            with ForeignCpu() as cpu:
                start = time.perf_counter()
                vectors[name] = run()
                rates[name].append(len(ids) / (time.perf_counter() - start))
            shares.append(cpu.share)
    diff = max((a - b).abs().max().item() for a, b in zip(vectors["ferrylm"], vectors["transformers"]))
    f, t = statistics.median(rates["ferrylm"]), statistics.median(rates["transformers"])
    print(f"CPU: {describe_cpu()}")
    print(f"{len(ids)} sequences of {min(map(len, ids))}-{max(map(len, ids))} tokens, batches of {args.batch}, "
          f"{args.rounds} alternating rounds (median); largest difference between the two sides' vectors "
          f"{diff:.2e}")
    print("| engine | sequences/s | ratio | foreign CPU (max) |\n|---|---:|---:|---:|")
    side = f"FerryLM (pooling, --dtype {args.dtype}, --quantization {args.quantization or 'default'})"
    print(f"| {side} | {f:.1f} | {f / t:.2f}x | {max(shares):.3f} |")
    print(f"| transformers (float32, padded batch) | {t:.1f} | 1.00x | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
