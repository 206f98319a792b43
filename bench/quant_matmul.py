"""Quantized matmul vs bf16 on SmolLM2-135M shapes: each linear alone, then a whole decode step.

Side by side in one run (methods alternate within every repetition; medians), because the machine is
shared: read the ratios, not the absolute times.

    .venv/bin/python bench/quant_matmul.py                 # linears at M = 1 and 64, then decode steps
    .venv/bin/python bench/quant_matmul.py --m 1,4,8,16,64 --no-step
    .venv/bin/python bench/quant_matmul.py --threads 1     # per-core cost
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ferrylm.config import QuantConfig  # noqa: E402
from ferrylm.model.quant.kernels import load_quant_kernels  # noqa: E402
from ferrylm.model.quant.layout import pack_q4  # noqa: E402
from ferrylm.model.quant.packed import PackedWeight  # noqa: E402
from ferrylm.model.quant.weight_only import quantize_int4, quantize_int8  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
LAYERS = 30


def clock() -> float:
    """Wall time; with one thread, that thread's CPU time (time the scheduler gave to other work on a
    busy machine does not count, so single-thread figures stay comparable)."""
    return time.thread_time() if torch.get_num_threads() == 1 else time.perf_counter()


def timed(fns: dict, reps: int) -> dict[str, float]:
    """Median seconds of each fn, the fns alternating within every repetition."""
    for f in fns.values():
        f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            start = clock()
            f()
            times[k].append(clock() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def linear_variants(n: int, k: int, kernels) -> dict[str, object]:
    """name → callable(x): bf16, our packed formats, and torch's own int8 / int4 ops."""
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(n, k, generator=gen) * 0.02).bfloat16()
    codes8, scales8 = quantize_int8(w)
    q4, s4, m4 = quantize_int4(w, 32)
    q8_0 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    d8_0 = (torch.rand(n, k // 32, generator=gen) * 1e-3).half()
    ours = {"int8": PackedWeight(codes8.view(torch.uint8), scales8, None, k, False, kernels),
            "int4 / Q4_1": PackedWeight(pack_q4(q4), s4, m4, 32, True, kernels),
            "Q8_0": PackedWeight(q8_0.view(torch.uint8), d8_0, None, 32, False, kernels)}
    t4 = torch._convert_weight_to_int4pack_for_cpu(q4.to(torch.int32), 1)
    sz = torch.stack((s4.float().t(), (m4.float() + 8 * s4.float()).t()), -1).bfloat16().contiguous()
    variants = {"bf16": lambda x: F.linear(x, w)}
    variants |= {name: p.matmul for name, p in ours.items()}
    variants["torch int8pack"] = lambda x: torch._weight_int8pack_mm(x, codes8, scales8.reshape(-1).bfloat16())
    variants["torch int4pack"] = lambda x: torch._weight_int4pack_mm_for_cpu(x, t4, 32, sz)
    return variants


def bench_linears(ms: list[int], reps: int, kernels) -> None:
    for m in ms:
        print(f"\nper linear, M = {m} (median µs; ratio = bf16 time / method time, >1 is faster)")
        rows, totals = [], {}
        for name, (n, k) in SHAPES.items():
            variants = linear_variants(n, k, kernels)
            x = torch.randn(m, k).bfloat16()
            n_reps = reps if name != "lm_head" else max(5, reps // 4)
            t = timed({v: (lambda f=f, x=x: f(x)) for v, f in variants.items()}, n_reps)
            rows.append((name, t))
            weight = 1 if name == "lm_head" else LAYERS
            for v, sec in t.items():
                totals[v] = totals.get(v, 0.0) + weight * sec
        cols = list(rows[0][1])
        print(f"{'shape':10s}" + "".join(f"{c:>18s}" for c in cols))
        for name, t in rows:
            print(f"{name:10s}" + "".join(f"{t[c] * 1e6:11.0f} ({t['bf16'] / t[c]:3.1f}x)" for c in cols))
        print(f"{'30 layers':10s}" + "".join(f"{totals[c] * 1e3:10.2f}ms ({totals['bf16'] / totals[c]:3.1f}x)"
                                              for c in cols))


def decode_step_models(methods: list[str]):
    from ferrylm.model.attention import AttentionSpec, select_backend
    from ferrylm.model.attention.cpu import cpu_fused_ops
    from ferrylm.model.loaders.loader import Checkpoint, load_model
    from ferrylm.model.loaders.model_source import resolve_model

    checkpoint = Checkpoint(resolve_model("smollm2-135m"))
    cpu = torch.device("cpu")
    spec = AttentionSpec.for_model(checkpoint.config, 16, torch.bfloat16, cpu)
    backend = select_backend(spec, "auto")
    models = {}
    for name in methods:
        models[name] = load_model(checkpoint, torch.bfloat16, cpu, backend, 2048, cpu_fused_ops(cpu),
                                  QuantConfig.parse(name))
        print(f"loaded {name}", flush=True)
    return checkpoint.config, models


def bench_decode_steps(batches: list[int], context: int, reps: int, methods: list[str]) -> None:
    """One decode step (every sequence one new token after `context` cached ones), logits included."""
    from ferrylm.model.forward_batch import ForwardBatch

    cfg, models = decode_step_models(methods)
    for b in batches:
        blocks_per_seq = -(-(context + 1) // 16)
        caches = [(torch.zeros(b * blocks_per_seq, 16, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16),
                   torch.zeros(b * blocks_per_seq, 16, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16))
                  for _ in range(cfg.num_layers)]
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(b)]
        batch = ForwardBatch.build([[100 + i] for i in range(b)], [context] * b, tables, 16)

        def step(model, batch=batch, caches=caches):
            with torch.inference_mode():
                return model.compute_logits(model(batch, caches))

        t = timed({name: (lambda m=m: step(m)) for name, m in models.items()}, reps)
        print(f"\ndecode step, {b} sequences x {context} cached tokens (median ms; tok/s = sequences / step)")
        for name, sec in t.items():
            print(f"  {name:6s} {sec * 1e3:8.2f} ms  {b / sec:8.1f} tok/s  {t['none'] / sec:4.2f}x vs bf16")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--m", default="1,64", help="activation rows for the per-linear table")
    p.add_argument("--batches", default="1,64", help="sequences per decode step")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--methods", default="none,gguf,int8,int4")
    p.add_argument("--no-step", action="store_true")
    p.add_argument("--no-linears", action="store_true")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = load_quant_kernels()
    if kernels is None:
        print("the C++ kernel did not build: only the torch fallbacks would run", file=sys.stderr)
        return 1
    what = "thread CPU time" if torch.get_num_threads() == 1 else "wall time"
    print(f"threads {torch.get_num_threads()} ({what}), AMX {kernels.has_amx}")
    if not args.no_linears:
        bench_linears([int(m) for m in args.m.split(",")], args.reps, kernels)
    if not args.no_step:
        bench_decode_steps([int(b) for b in args.batches.split(",")], args.context, max(5, args.reps // 4),
                           args.methods.split(","))
    return 0


if __name__ == "__main__":
    sys.exit(main())
