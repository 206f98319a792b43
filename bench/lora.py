"""LoRA throughput: 64 streams spread over 8 adapters (rank 16 on q/k/v/o/gate/up/down, peft's
format, random weights on SmolLM2-135M's shapes) against the same 64 streams on the base model, in
one process, alternating rounds: (a) adapters, (b) the same --enable-lora engine with no adapter
requested, (c) a plain engine (compiled decode step, as `ferrylm serve` runs without --enable-lora).
Also the adapter load time. Prints output tokens/s, the ratios, the CPU (lscpu flags) and the CPU
share anything else used (/proc/stat).

    .venv/bin/python bench/lora.py [--streams 64] [--adapters 8] [--tokens 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.anchors.cpu import describe_cpu  # noqa: E402
from bench.cpu_check import ForeignCpu  # noqa: E402
from ferrylm import LLM, LoRARequest, SamplingParams  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(directory: Path, count: int, rank: int) -> list[Path]:
    """peft adapters on a random model of SmolLM2-135M's shapes (only the shapes matter to the adapter)."""
    import transformers
    from peft import LoraConfig, get_peft_model

    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                      num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    paths = []
    for i in range(count):
        torch.manual_seed(i)
        model = get_peft_model(transformers.LlamaForCausalLM(config),
                               LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS, init_lora_weights=False))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.normal_(0, 0.02)
        paths.append(directory / f"adapter{i}")
        model.save_pretrained(paths[-1])
    return paths


def run(llm: LLM, prompts: list[str], loras: list[LoRARequest | None], tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    prompts = [f"Write a short note number {i} about ferries, harbours and the sea at dawn."
               for i in range(args.streams)]
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_adapters(Path(tmp), args.adapters, args.rank)
        lora = LLM("smollm2-135m", enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
                   max_num_seqs=args.streams, enable_prefix_caching=False)
        plain = LLM("smollm2-135m", max_num_seqs=args.streams, enable_prefix_caching=False)
        plain.engine.executor.wait_compiled()  # type: ignore[attr-defined]
        load_s = []
        for i, path in enumerate(paths):
            start = time.perf_counter()
            lora.engine.adapters.add(f"a{i}", str(path))
            load_s.append(time.perf_counter() - start)
        requests = [LoRARequest(f"a{i % args.adapters}", i % args.adapters + 1, str(paths[i % args.adapters]))
                    for i in range(args.streams)]
        sides = {"adapters": (lora, requests), "base, --enable-lora engine": (lora, [None] * args.streams),
                 "base, plain engine (compiled)": (plain, [None] * args.streams)}
        for llm, loras in sides.values():  # warm every path (adapters into their slots)
            run(llm, prompts[:8], loras[:8], 4)
        rates: dict[str, list[float]] = {name: [] for name in sides}
        shares = []
        for _ in range(args.rounds):
            for name, (llm, loras) in sides.items():
                with ForeignCpu() as cpu:
                    rates[name].append(run(llm, prompts, loras, args.tokens))
                shares.append(cpu.share)
    med = {name: statistics.median(r) for name, r in rates.items()}
    print(f"CPU: {describe_cpu()}")
    print(f"{args.streams} streams, {args.tokens} output tokens each, {args.adapters} adapters of rank {args.rank} on "
          f"{', '.join(TARGETS)}; {args.rounds} alternating rounds (median); foreign CPU max {max(shares):.3f}")
    print(f"adapter load: median {statistics.median(load_s) * 1000:.0f} ms, max {max(load_s) * 1000:.0f} ms")
    print("| run | output tok/s | vs base (same engine) | vs plain engine |\n|---|---:|---:|---:|")
    for name, rate in med.items():
        print(f"| {name} | {rate:.1f} | {rate / med['base, --enable-lora engine']:.2f}x | "
              f"{rate / med['base, plain engine (compiled)']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
