"""The CPU attention / elementwise kernels per instruction-set variant (portable, avx2, avx512_bf16):
one SmolLM2-135M layer's decode attention (64 sequences x 320 tokens; 9 query heads, 3 KV heads,
head_dim 64, block 16; fp32 and bf16 caches), and add_rms_norm_ / rope_qkv_ on [64, 576].

Median ms per call (--stat min: the fastest sample, less sensitive to a busy machine), the variants
alternating within every repetition, because the machine is shared: compare within one run only.

    .venv/bin/python bench/attention_variants.py
    .venv/bin/python bench/attention_variants.py --variants avx2,avx512_bf16 --reps 50 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ferrylm.model.arch.layers import RotaryEmbedding  # noqa: E402
from ferrylm.model.attention.cpu_kernels import load_cpu_kernels  # noqa: E402
from ferrylm.model.cpu.cpu_isa import BY_NAME, this_cpu  # noqa: E402

SEQS, TOKENS, HEADS, KV_HEADS, HEAD_DIM, BLOCK, HIDDEN = 64, 320, 9, 3, 64, 16, 576


def decode_case(dtype: torch.dtype, gen: torch.Generator):
    """Arguments of one layer's decode attention: shuffled blocks, as a long-running pool has them."""
    per_seq = -(-TOKENS // BLOCK)
    num_blocks = SEQS * per_seq
    tables = torch.randperm(num_blocks, generator=gen).view(SEQS, per_seq)
    k_cache, v_cache = (torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(SEQS, HEADS, HEAD_DIM, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, torch.full((SEQS,), TOKENS), HEAD_DIM ** -0.5


def cases(kernels, dtype: torch.dtype, gen: torch.Generator) -> dict[str, object]:
    """name -> zero-argument call of this variant's op, each on inputs of its own (the ops write in place)."""
    name = "fp32" if dtype == torch.float32 else "bf16"
    args = decode_case(dtype, gen)
    x, residual = (torch.randn(SEQS, HIDDEN, generator=gen).to(dtype) for _ in range(2))
    weight = torch.rand(HIDDEN, generator=gen).add(0.5).to(dtype)
    rope = RotaryEmbedding(HEAD_DIM, 4096, 100000.0, None)
    qk = torch.randn(SEQS, HIDDEN, generator=gen).to(dtype)
    positions = torch.randint(0, 4000, (SEQS,), generator=gen)
    return {
        f"decode {name}": lambda: kernels.paged_decode_attention(*args),
        f"rms_norm {name}": lambda: kernels.add_rms_norm_(x, residual, weight, 1e-5),
        f"rope {name}": lambda: kernels.rope_qkv_(qk, positions, rope.cos, rope.sin, HIDDEN // HEAD_DIM, HEAD_DIM),
    }


def timed(calls: dict[str, dict[str, object]], reps: int, inner: dict[str, int],
          stat=statistics.median) -> dict[str, dict[str, float]]:
    """stat (median) of the ms per call of calls[variant][case]; variants alternate within every
    repetition, and a case too short to time alone runs inner[case] times per sample."""
    for per_variant in calls.values():
        for f in per_variant.values():
            f()
    samples = {v: {c: [] for c in cs} for v, cs in calls.items()}
    for _ in range(reps):
        for variant, per_variant in calls.items():
            for case, f in per_variant.items():
                start = time.perf_counter()
                for _ in range(inner[case]):
                    f()
                samples[variant][case].append((time.perf_counter() - start) * 1e3 / inner[case])
    return {v: {c: stat(s) for c, s in cs.items()} for v, cs in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="portable,avx2,avx512_bf16")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--stat", choices=["median", "min"], default="median")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu = this_cpu()
    variants = [v for v in args.variants.split(",") if cpu.supports(BY_NAME[v])]
    skipped = sorted(set(args.variants.split(",")) - set(variants))
    calls = {}
    for v in variants:
        kernels = load_cpu_kernels(v)
        if kernels is None:
            sys.exit(f"the {v} kernels do not build here")
        gen = torch.Generator().manual_seed(0)  # every variant gets the same inputs
        calls[v] = {**cases(kernels, torch.float32, gen), **cases(kernels, torch.bfloat16, gen)}
    inner = {c: 1 if c.startswith("decode") else 100 for c in calls[variants[0]]}
    medians = timed(calls, args.reps, inner, statistics.median if args.stat == "median" else min)
    print(f"{cpu.model}, {args.threads} threads, {args.stat} ms per call over {args.reps} reps"
          + (f" (not run here: {', '.join(skipped)})" if skipped else ""))
    print(f"{'case':<16}" + "".join(f"{v:>14}" for v in variants))
    for case in calls[variants[0]]:
        print(f"{case:<16}" + "".join(f"{medians[v][case]:>14.4f}" for v in variants))


if __name__ == "__main__":
    main()
