"""The quantized GEMV per instruction-set variant, on SmolLM2-135M's Q4_1 shapes (one activation row, or
--rows: the 2..8 of a speculative verify step).

For each variant this CPU runs (cpu_isa.py: portable = the scalar twin, avx2, avx512, avx512_bf16, ...):
quant_linear (the exact path, fp32 x) and quant_linear_vnni (x rounded to int8 per 32: AVX512-VNNI or
AVX2 vpmaddubsw), beside torch's fp32 F.linear on the dequantized weight and the time torch takes to
read as many bytes as the packed weight holds (max over an fp32 tensor: a bandwidth ceiling). Methods
alternate within every repetition and the median is reported, because the machine is shared: compare
within one run.

    FERRYLM_CACHE_DIR=/tmp/fcache_quant .venv/bin/python bench/quant_variants.py
    .venv/bin/python bench/quant_variants.py --variants avx2,avx512_bf16 --reps 200 --threads 1
    .venv/bin/python bench/quant_variants.py --variants avx2,avx512_bf16 --rows 1,2,3,4,5,6,7,8 --dtype bfloat16
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

from ferrylm.model.cpu.cpu_isa import BY_NAME, this_cpu  # noqa: E402
from ferrylm.model.quant.kernels import load_quant_kernels  # noqa: E402
from ferrylm.model.quant.layout import dequantize_packed, pack_q4  # noqa: E402

SHAPES = {"q / o 576x576": (576, 576), "gate / up 1536x576": (1536, 576), "down 576x1536": (576, 1536),
          "lm_head 49152x576": (49152, 576)}


def q4_1(n: int, k: int) -> tuple:
    """A random Q4_1 weight as the packed layout holds it: codes, fp16 scales and mins per 32."""
    gen = torch.Generator().manual_seed(0)
    scales = (torch.rand(n, k // 32, generator=gen) * 0.01).half()
    mins = (-8 * scales.float() + torch.randn(n, k // 32, generator=gen) * 1e-3).half()
    return pack_q4(torch.randint(0, 16, (n, k), generator=gen)), scales, mins, 32, True


def weight_bytes(w: tuple) -> int:
    codes, scales, mins = w[:3]
    return sum(t.numel() * t.element_size() for t in (codes, scales, mins))


def timed(fns: dict, reps: int) -> dict[str, float]:
    """Median seconds per call of each fn, the fns alternating within every repetition."""
    for f in fns.values():
        f(), f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            start = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def methods(w: tuple, x: torch.Tensor, kernels: dict) -> dict:
    dense = dequantize_packed(*w).to(x.dtype)
    same_bytes = torch.randn(weight_bytes(w) // 4)  # reading as many bytes: a bandwidth ceiling
    fns = {"read (max)": lambda: same_bytes.max(), f"torch {str(x.dtype)[6:]}": lambda: F.linear(x, dense)}
    for name, k in kernels.items():
        fns[f"{name} exact"] = lambda k=k: k.quant_linear(x, *w)
        if k.has_vnni:
            fns[f"{name} int8"] = lambda k=k: k.quant_linear_vnni(x, *w)
    return fns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="portable,avx2,avx512,avx512_bf16")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1", help="activation rows M, comma-separated")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="of x")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernels = {}
    for name in args.variants.split(","):
        if not this_cpu().supports(BY_NAME[name]):
            print(f"skip {name}: this CPU lacks {sorted(BY_NAME[name].requires - this_cpu().flags)}")
        elif (k := load_quant_kernels(name)) is None:
            print(f"skip {name}: did not build")
        else:
            kernels[name] = k
    dtype = getattr(torch, args.dtype)
    for m in (int(v) for v in args.rows.split(",")):
        print(f"\nM = {m}, {args.dtype} x, {args.threads} threads: median ms per call (GB/s of packed weight read)")
        rows = []
        for label, (n, k) in SHAPES.items():
            w = q4_1(n, k)
            x = torch.randn(m, k).to(dtype)
            reps = args.reps if n * k < 10_000_000 else max(10, args.reps // 5)
            t = timed(methods(w, x, kernels), reps)
            rows.append((label, weight_bytes(w), t))
        names = list(rows[0][2])
        print(f"{'shape':<20}" + "".join(f"{n:>22}" for n in names))
        for label, size, t in rows:
            print(f"{label:<20}" + "".join(f"{t[n] * 1e3:>12.3f} ({size / t[n] / 1e9:5.1f})" for n in names))


if __name__ == "__main__":
    main()
