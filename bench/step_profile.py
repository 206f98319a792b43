"""Where a decode step's time goes: the default model's eager step, op by op, grouped by job.

Runs `rows` sequences (16-token prompts) through the offline `LLM` with its default configuration but
eager (compiled graphs hide their ops from the profiler), profiles the decode steps with torch.profiler
and prints ms per step by group: quantized matmuls (ferrylm's int8 / packed / AMX kernels, panels +
GEMM), attention, fused norms / RoPE / KV writes, other torch ops, and what is left (Python: scheduler,
batch building, sampling glue). The compiled step's wall time is printed beside it for scale.

    .venv/bin/python bench/step_profile.py [--rows 1,64] [--tokens 48]
    FERRYLM_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 .venv/bin/python bench/step_profile.py   # the AVX2 row
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu_check import ForeignCpu  # noqa: E402
from ferrylm import LLM, SamplingParams  # noqa: E402
from ferrylm.model.cpu.cpu_isa import select_variant, this_cpu  # noqa: E402

GROUPS = [  # (group, substrings of the op name); first match wins
    ("fused MoE experts op (int8 activations)", ("quant_moe_experts",)),
    ("quantized matmul (int8 activations)", ("quant_linear_vnni",)),
    ("quantized matmul (packed / AMX)", ("quant_linear",)),
    ("unpack panels + GEMM", ("quant_dequantize", "aten::mm", "aten::addmm", "aten::linear", "aten::matmul")),
    ("attention", ("paged_decode_attention", "attention", "sdpa")),
    ("fused norm / RoPE / KV write", ("rms_norm", "rope_qkv", "write_kv", "reshape_and_cache")),
]


SHOWN_FLAGS = {"avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile"}


def group_of(name: str) -> str:
    return next((g for g, keys in GROUPS if any(k in name for k in keys)), "other torch ops")


def run(llm: LLM, rows: int, tokens: int, prompt: list[int]) -> int:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompt} for _ in range(rows)], [params] * rows, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs)


def profile_rows(rows: int, tokens: int) -> dict:
    prompt = list(range(1000, 1016))
    out = {}
    for eager in (False, True):
        llm = LLM("smollm2-135m", dtype="auto", max_num_seqs=64, seed=0, enforce_eager=eager,
                  enable_prefix_caching=False)
        runner = llm.engine.executor
        if not eager and hasattr(runner, "wait_compiled"):
            runner.wait_compiled()
        run(llm, rows, tokens, prompt)  # warm-up
        with ForeignCpu() as cpu:
            start = time.perf_counter()
            if eager:
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    run(llm, rows, tokens, prompt)
            else:
                run(llm, rows, tokens, prompt)
            wall = time.perf_counter() - start
        out["compiled" if not eager else "eager"] = wall * 1e3 / tokens
        out["foreign"] = max(out.get("foreign", 0.0), cpu.share)
        out["dtype"] = str(runner.dtype).removeprefix("torch.")
        if eager:
            groups: dict[str, float] = defaultdict(float)
            for evt in prof.key_averages():
                if evt.key.startswith(("aten::", "ferrylm")) or "::" in evt.key:
                    groups[group_of(evt.key)] += evt.self_cpu_time_total / 1e3 / tokens
            out["groups"] = dict(groups)
        del llm
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,64")
    ap.add_argument("--tokens", type=int, default=48, help="decode steps per run (the prompt's prefill included)")
    args = ap.parse_args()
    torch.manual_seed(0)
    cpu = this_cpu()
    print(f"CPU: {cpu.model}, {os.cpu_count()} CPUs; "
          f"kernels {select_variant().name} (FERRYLM_CPU_ISA={os.environ.get('FERRYLM_CPU_ISA', 'auto')}); "
          f"flags {' '.join(sorted(cpu.flags & SHOWN_FLAGS))}")
    for rows in (int(r) for r in args.rows.split(",")):
        r = profile_rows(rows, args.tokens)
        print(f"\n{rows} sequences, {r['dtype']} activations: ms per step (eager step profiled op by op; "
              f"foreign CPU {r['foreign']:.1%})")
        print("| part | ms per step | share of the eager step |\n|---|---|---|")
        total = r["eager"]
        for name, ms in sorted(r["groups"].items(), key=lambda kv: -kv[1]):
            print(f"| {name} | {ms:.2f} | {ms / total:.0%} |")
        rest = total - sum(r["groups"].values())
        print(f"| Python (scheduler, batch building, sampling glue) | {rest:.2f} | {rest / total:.0%} |")
        print(f"| **eager step** | **{total:.2f}** | |")
        print(f"| **compiled step (the default)** | **{r['compiled']:.2f}** | |")


if __name__ == "__main__":
    main()
