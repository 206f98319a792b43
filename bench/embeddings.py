"""Embeddings throughput: FerryLM's pooling path (the offline LLM with `pooling="last"`, as
`--runner pooling` serves it, default --dtype) against the peers on the same model and the same
texts, alternating rounds in one process:

- transformers, float32, one padded batch of `--batch` texts at a time in the given order;
- transformers, float32, the texts sorted by length first (what sentence-transformers' `encode` does);
- sentence-transformers itself (`encode(batch_size=--batch)`) on the same weights written as a
  sentence-transformers checkpoint (float32 safetensors, last-token pooling, Normalize), when it is
  importable (`pip install --no-deps --target bench/.peers/st-lib sentence-transformers`: its own
  folder, git-ignored; the bench puts it on sys.path).

All sides pool the last token's final hidden state and L2-normalise it. Two workloads (`--lengths`):
`even`, short sentences of 18-26 tokens (no padding to save: the GEMMs are the same on every
side), and `mixed`, passages cut from bench/corpus.txt at lengths drawn log-uniformly from
16..512 tokens with a fixed seed (what a RAG index embeds: chunks and queries together).
Prints sequences/s per side, the ratios, the largest difference between FerryLM's vectors and
transformers', the CPU (lscpu flags) and the CPU share anything else used (/proc/stat).

    .venv/bin/python bench/embeddings.py [--lengths even mixed] [--batch 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ST_LIB = ROOT / "bench" / ".peers" / "st-lib"

from bench.anchors.cpu import describe_cpu  # noqa: E402
from bench.cpu_check import ForeignCpu  # noqa: E402
from ferrylm import LLM, SamplingParams  # noqa: E402
from ferrylm.model.loaders.model_source import resolve_model  # noqa: E402

SENTENCES = ["The ferry leaves the harbour at dawn and crosses the fjord in forty minutes.",
             "Embeddings map a sentence to a vector whose direction carries its meaning.",
             "A long pier, a few gulls and a lighthouse that has not been lit for years.",
             "The engine's scheduler batches prompts so that every core stays busy.",
             "Bring a warm coat: the wind on the upper deck is cold even in summer."]


def workload(kind: str, count: int, tok) -> list[str]:
    """`count` texts: `even` short sentences, or `mixed` corpus passages of 16..512 tokens (seed 0)."""
    if kind == "even":
        return [f"{SENTENCES[i % len(SENTENCES)]} (item {i})" for i in range(count)]
    corpus = tok.encode((ROOT / "bench" / "corpus.txt").read_text())
    rng = random.Random(0)
    texts = []
    for _ in range(count):
        length = int(math.exp(rng.uniform(math.log(16), math.log(512))))
        start = rng.randrange(0, len(corpus) - length)
        texts.append(tok.decode(corpus[start:start + length]))
    return texts


def transformers_side(model, ids: list[list[int]], batch: int, sort: bool) -> list[torch.Tensor]:
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i])) if sort else list(range(len(ids)))
    out: dict[int, torch.Tensor] = {}
    with torch.inference_mode():
        for at in range(0, len(order), batch):
            chunk = order[at:at + batch]
            width = max(len(ids[i]) for i in chunk)
            input_ids = torch.tensor([ids[i] + [0] * (width - len(ids[i])) for i in chunk])
            mask = torch.tensor([[1] * len(ids[i]) + [0] * (width - len(ids[i])) for i in chunk])
            hidden = model.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
            last = hidden[torch.arange(len(chunk)), mask.sum(1) - 1]
            for i, vector in zip(chunk, torch.nn.functional.normalize(last.float(), dim=-1)):
                out[i] = vector
    return [out[i] for i in range(len(ids))]


def ferrylm_side(llm: LLM, ids: list[list[int]], batch: int) -> list[torch.Tensor]:
    """`batch` texts per generate() call, as a client sending `input` lists of `batch` would."""
    params = SamplingParams(max_tokens=0, pooling="last")
    out = []
    for at in range(0, len(ids), batch):
        results = llm.generate([{"prompt_token_ids": p} for p in ids[at:at + batch]], params, use_tqdm=False)
        out += [torch.tensor(r.pooled) for r in results]
    return out


def st_checkpoint(hf, tokenizer, directory: Path) -> Path:
    """The transformers model's weights as a sentence-transformers checkpoint: last-token pooling, Normalize."""
    hf.model.save_pretrained(directory, safe_serialization=True)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    tokenizer.save_pretrained(directory)
    (directory / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 2048,
                                                                     "do_lower_case": False}))
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": hf.config.hidden_size, "pooling_mode_lasttoken": True,
         "pooling_mode_mean_tokens": False, "pooling_mode_cls_token": False, "pooling_mode_max_tokens": False,
         "include_prompt": True}))
    (directory / "2_Normalize").mkdir()
    return directory


def sentence_transformers_model(hf, tokenizer, directory: Path):
    """sentence-transformers on `hf`'s weights, or None when it is not installed."""
    sys.path.insert(0, str(ST_LIB))
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        return None
    return SentenceTransformer(str(st_checkpoint(hf, tokenizer, directory)), device="cpu")


def measure(kind: str, args, hf, llm: LLM, st) -> list[str]:
    """One workload: alternating rounds of every side; the table's rows."""
    tok = llm.get_tokenizer()
    texts = workload(kind, args.batch * args.batches, tok)
    ids = [tok.encode(t) for t in texts]
    sides: dict[str, Callable[[], list[torch.Tensor]]] = {
        "ferrylm": lambda: ferrylm_side(llm, ids, args.batch),
        "transformers": lambda: transformers_side(hf, ids, args.batch, sort=False),
        "transformers-sorted": lambda: transformers_side(hf, ids, args.batch, sort=True)}
    if st is not None:
        sides["sentence-transformers"] = lambda: list(st.encode(texts, batch_size=args.batch, convert_to_tensor=True))
    for run in sides.values():  # warm every side
        run()
    rates: dict[str, list[float]] = {name: [] for name in sides}
    shares, vectors = [], {}
    for _ in range(args.rounds):
        for name, run in sides.items():
            with ForeignCpu() as cpu:
                start = time.perf_counter()
                vectors[name] = run()
                rates[name].append(len(ids) / (time.perf_counter() - start))
            shares.append(cpu.share)
    diffs = {name: max((a - b.float()).abs().max().item() for a, b in zip(vectors["ferrylm"], vectors[name]))
             for name in sides if name != "ferrylm"}
    median = {name: statistics.median(r) for name, r in rates.items()}
    lengths = sorted(map(len, ids))
    padded = sum(max(len(ids[i]) for i in range(at, min(at + args.batch, len(ids)))) * min(args.batch, len(ids) - at)
                 for at in range(0, len(ids), args.batch))
    print(f"\n{kind}: {len(ids)} texts of {lengths[0]}-{lengths[-1]} tokens (median {lengths[len(lengths) // 2]}, "
          f"{sum(lengths)} in all; {padded} with padding in request order), batches of {args.batch}, "
          f"{args.rounds} alternating rounds (median); foreign CPU max {max(shares):.3f}")
    rows = [f"| {kind} | {label} | {median[name]:.1f} | {median['ferrylm'] / median[name]:.2f}x | "
            f"{diffs.get(name, 0.0):.1e} |"
            for name, label in (("transformers", "transformers, float32, padded batches in request order"),
                                ("transformers-sorted", "transformers, float32, sorted by length, then batched"),
                                ("sentence-transformers", "sentence-transformers `encode` (sorts by length)"))
            if name in median]
    side = f"FerryLM (pooling, --dtype {args.dtype}, --quantization {args.quantization or 'default'})"
    return [f"| {kind} | {side} | {median['ferrylm']:.1f} | 1.00x | |", *rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", nargs="+", choices=("even", "mixed"), default=["even", "mixed"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="auto", help="FerryLM's --dtype (auto: what serve picks on this CPU)")
    ap.add_argument("--quantization", default=None, help="FerryLM's --quantization (default: GGUF kept packed)")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_model("smollm2-135m")
    hf = AutoModelForCausalLM.from_pretrained(str(source.directory), gguf_file=source.path.name,
                                              dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(str(source.directory), gguf_file=source.path.name)
    llm = LLM("smollm2-135m", dtype=args.dtype, quantization=args.quantization, enforce_eager=True,
              max_num_seqs=args.batch, max_num_batched_tokens=4096, enable_prefix_caching=False)
    with tempfile.TemporaryDirectory(prefix="ferrylm-st-") as tmp:
        st = sentence_transformers_model(hf, hf_tok, Path(tmp) / "st")
        rows = [row for kind in args.lengths for row in measure(kind, args, hf, llm, st)]
    print(f"\nCPU: {describe_cpu()}")
    print("| texts | engine | sequences/s | FerryLM / this | largest vector difference to FerryLM's |\n"
          "|---|---|---:|---:|---:|")
    print("\n".join(rows))
    if st is None:
        print(f"(sentence-transformers not found: pip install --no-deps --target {ST_LIB} sentence-transformers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
