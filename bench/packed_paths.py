"""Which PackedWeight path is fastest at each activation row count M: the exact packed kernel (reads
the weight once per 8 rows), the int8-activation kernel (any M), AMX tiles (bf16), or panels unpacked
to the activation dtype + torch's GEMM. Sets packed.py's INT8_M / INT8_FP32_M, SMALL_M and AMX_M.

    .venv/bin/python bench/packed_paths.py [--m 1,4,5,8,12,16,24,32,48,64] [--reps 20]

Q4_1 weights (the default model's format) on SmolLM2-135M's shapes, 30 layers + the LM head summed;
paths alternate within every repetition (medians), and /proc/stat says what else used the CPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu_check import ForeignCpu  # noqa: E402
from ferrylm.model.quant.kernels import load_quant_kernels  # noqa: E402
from ferrylm.model.quant.layout import pack_q4  # noqa: E402
from ferrylm.model.quant.packed import PackedWeight  # noqa: E402
from ferrylm.model.quant.weight_only import quantize_int4  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
LAYERS = 30


def paths(p: PackedWeight, dtype: torch.dtype, m: int) -> dict:
    k = p.kernels
    out = {"kernel": lambda x: k.quant_linear(x, p.codes, p.scales, p.mins, p.group, p.q4),
           "panel": lambda x: torch.nn.functional.linear(x, p._unpack(slice(None), x.dtype))}
    if k.has_vnni:  # any row count; fp32 x takes it under --dtype auto on CPUs without BF16
        out["int8"] = lambda x: k.quant_linear_vnni(x, p.codes, p.scales, p.mins, p.group, p.q4)
    if dtype == torch.bfloat16 and k.has_amx:
        out["amx"] = lambda x: k.quant_linear_amx(x, p.codes, p.scales, p.mins, p.group, p.q4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="1,4,5,8,12,16,24,32,48,64")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()
    kernels = load_quant_kernels()
    gen = torch.Generator().manual_seed(0)
    weights = {}
    for name, (n, k) in SHAPES.items():
        q4, s4, m4 = quantize_int4((torch.randn(n, k, generator=gen) * 0.02).bfloat16(), 32)
        weights[name] = PackedWeight(pack_q4(q4), s4, m4, 32, True, kernels)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    for dtype in (dtypes[d] for d in args.dtypes.split(",")):
        print(f"\n{dtype}: ms per 30 layers + LM head (median of {args.reps}); best path in bold")
        header = None
        with ForeignCpu() as cpu, torch.inference_mode():
            for m in (int(v) for v in args.m.split(",")):
                totals: dict[str, float] = {}
                for name, w in weights.items():
                    x = torch.randn(m, w.in_features, generator=gen).to(dtype)
                    fns = paths(w, dtype, m)
                    for f in fns.values():
                        f(x)
                    samples: dict[str, list[float]] = {p: [] for p in fns}
                    for _ in range(args.reps if name != "lm_head" else max(3, args.reps // 4)):
                        for p, f in fns.items():
                            t0 = time.perf_counter()
                            f(x)
                            samples[p].append(time.perf_counter() - t0)
                    for p, v in samples.items():
                        totals[p] = totals.get(p, 0.0) + statistics.median(v) * (1 if name == "lm_head" else LAYERS)
                if header is None or len(totals) > len(header):
                    header = list(totals)
                    print("| M | " + " | ".join(header) + " |\n|---:|" + "---:|" * len(header))
                best = min(totals, key=totals.get)
                print(f"| {m} | " + " | ".join("-" if p not in totals else f"**{totals[p] * 1e3:.2f}**" if p == best
                                                else f"{totals[p] * 1e3:.2f}" for p in header) + " |")
        print(f"(CPU used by other processes meanwhile: {cpu.share:.1%})")


if __name__ == "__main__":
    main()
