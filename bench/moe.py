"""Mixture-of-experts decode on the CPU: FerryLM vs transformers on the same random-weight Qwen3-MoE
(built from transformers' config class in a temp dir), same run, same prompts.

Shape (default): hidden 1024, 12 layers, 32 experts of width 512, top 4, 16/4 heads of 64, vocab
32,000: ~0.7B parameters, ~0.15B active per token. Workloads: one stream and 16 streams, 64 greedy
tokens out of 32-token prompts; decode tokens/s. FerryLM: bf16 and `--quantization int8` (experts
packed); transformers: bf16 generate() with its own MoE implementation. Then a profile of one
16-row FerryLM decode step's MoE blocks: router, grouping, expert GEMMs, scatter-add.

    .venv/bin/python bench/moe.py            # ~10 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu_check import ForeignCpu  # noqa: E402
from ferrylm import LLM, SamplingParams  # noqa: E402

SHAPE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=16,
             num_key_value_heads=4, head_dim=64, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512,
             norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False)
PROMPT, OUT = 32, 64


def build(directory: Path) -> tuple[int, int]:
    """Save the random model; (total parameters, active parameters per token)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**SHAPE)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)
    total = sum(p.numel() for p in model.parameters())
    expert = 3 * SHAPE["hidden_size"] * SHAPE["moe_intermediate_size"]
    active = total - SHAPE["num_hidden_layers"] * expert * (SHAPE["num_experts"] - SHAPE["num_experts_per_tok"])
    from tests.model.tiny_models import add_word_tokenizer

    add_word_tokenizer(directory, SHAPE["vocab_size"])
    return total, active


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, SHAPE["vocab_size"], (PROMPT,), generator=g).tolist() for _ in range(n)]


def ferrylm_decode(llm: LLM, batch: int) -> float:
    """Output tokens/s of the decode phase: the tokens after each request's first, over the time from the
    earliest first token to the latest last one (the engine's own timestamps), as llama-batched-bench's
    S_TG times its generation loop alone. (This subtracted a 1-token run's time until the thirteenth
    session; with the prefix cache on, that run's prompt was a cache hit while the full run's was not, so
    55-65 ms of prefill a run were counted as decode: 1 stream read ~112 tok/s where its steps ran ~134.)"""
    ps = [{"prompt_token_ids": p} for p in prompts(batch)]
    full = SamplingParams(temperature=0.0, max_tokens=OUT, ignore_eos=True)
    llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)  # warm
    llm.engine.scheduler.block_manager.reset_prefix_cache()
    metrics = [out.metrics for out in llm.generate(ps, full, use_tqdm=False)]
    first = min(m.first_token_time for m in metrics)
    last = max(m.last_token_time for m in metrics)
    return batch * (OUT - 1) / (last - first)


@torch.inference_mode()
def transformers_decode(model, batch: int) -> float:
    ids = torch.tensor(prompts(batch))
    mask = torch.ones_like(ids)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate(ids, attention_mask=mask, max_new_tokens=2, min_new_tokens=2, **kw)  # warm
    start = time.perf_counter()
    model.generate(ids, attention_mask=mask, max_new_tokens=1, min_new_tokens=1, **kw)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    model.generate(ids, attention_mask=mask, max_new_tokens=OUT, min_new_tokens=OUT, **kw)
    return batch * (OUT - 1) / (time.perf_counter() - start - prefill)


@torch.inference_mode()
def moe_profile(llm: LLM, rows: int = 16) -> dict[str, float]:
    """ms per decode step, summed over every MoE block, of each phase (one block's forward re-run
    by hand with timers, on `rows` random activations of the model's dtype)."""
    from ferrylm.model.arch.moe import SparseMoeBlock

    blocks = [m for m in llm.engine.executor.model.modules() if isinstance(m, SparseMoeBlock)]
    gate = blocks[0].gate  # the router: the model's hidden size and activation dtype
    x = torch.randn(rows, gate.in_features, dtype=gate.weight.dtype)
    if all(block._fused(x) for block in blocks):
        return _fused_profile(blocks, x)
    phases = dict.fromkeys(("router + top-k", "grouping", "expert GEMMs", "scatter-add"), 0.0)
    for _ in range(3):  # warm, then the last two counted
        for key in phases:
            phases[key] *= 0
        for block in blocks:
            t0 = time.perf_counter()
            probs = torch.softmax(block.router_logits(x).float(), dim=-1)
            weights, chosen = probs.topk(block.top_k, dim=-1)
            weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
            t1 = time.perf_counter()
            flat = chosen.flatten()
            order = torch.argsort(flat, stable=True)
            tokens = order // block.top_k
            counts = torch.bincount(flat, minlength=len(block.experts)).tolist()
            routed = weights.flatten()[order, None]
            t2 = time.perf_counter()
            outs, start = [], 0
            for expert, count in zip(block.experts, counts):
                if count:
                    rows_ = tokens[start:start + count]
                    outs.append((rows_, expert(x.index_select(0, rows_)) * routed[start:start + count]))
                    start += count
            t3 = time.perf_counter()
            out = torch.zeros_like(x)
            for rows_, y in outs:
                out.index_add_(0, rows_, y)
            t4 = time.perf_counter()
            for key, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                phases[key] += dt * 1000
    return phases


def _fused_profile(blocks: list, x: torch.Tensor) -> dict[str, float]:
    """moe_profile where every block runs the fused op (arch/moe.py's StackedExperts): the router, then the
    one C++ call that does top-k, grouping, the experts' GEMVs, SiLU and the weighted sum."""
    phases = dict.fromkeys(("router", "fused experts op (top-k, grouping, expert GEMMs, SiLU, weighted sum)"), 0.0)
    for _ in range(3):  # warm, then the last one counted
        for key in phases:
            phases[key] *= 0
        for block in blocks:
            t0 = time.perf_counter()
            logits = block.router_logits(x)
            t1 = time.perf_counter()
            block.stacked(x, logits, block.top_k, block.routing)
            t2 = time.perf_counter()
            for key, dt in zip(phases, (t1 - t0, t2 - t1)):
                phases[key] += dt * 1000
    return phases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.parse_args()
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next((line.split(":", 1)[1].strip() for line in flags.splitlines() if line.startswith("Model name")),
                      "?")
    wanted = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile") if f" {f}" in flags]
    print(f"CPU: {model_name}, flags {' '.join(wanted)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="ferrylm-moe-") as tmp:
        directory = Path(tmp)
        total, active = build(directory)
        print(f"random Qwen3-MoE: {total / 1e9:.2f}B parameters, {active / 1e9:.2f}B active per token")
        import transformers

        for name, make in [("FerryLM bf16", lambda: LLM(str(directory), dtype="bfloat16", enforce_eager=True)),
                           ("FerryLM int8 (experts packed)", lambda: LLM(str(directory), dtype="bfloat16",
                                                                        enforce_eager=True, quantization="int8")),
                           ("transformers bf16 generate()", lambda: transformers.AutoModelForCausalLM.from_pretrained(
                               str(directory), dtype=torch.bfloat16).eval())]:
            engine = make()
            figures = []
            for batch in (1, 16):
                with ForeignCpu() as cpu:
                    rate = ferrylm_decode(engine, batch) if isinstance(engine, LLM) else \
                        transformers_decode(engine, batch)
                figures.append((batch, rate, cpu.share))
            profile = moe_profile(engine) if name == "FerryLM bf16" else None
            rows.append((name, figures, profile))
            del engine
    print("\n| engine | 1 stream: decode tok/s | 16 streams: decode tok/s | other processes' CPU share |")
    print("|---|---|---|---|")
    for name, figures, _ in rows:
        print(f"| {name} | {figures[0][1]:.1f} | {figures[1][1]:.1f} | "
              f"{max(f[2] for f in figures):.3f} |")
    for name, _, profile in rows:
        if profile:
            print(f"\n{name}, one 16-row decode step, MoE blocks only (ms, all layers): "
                  + ", ".join(f"{k} {v:.1f}" for k, v in profile.items()))


if __name__ == "__main__":
    main()
