"""Triton kernels vs the torch-native oracle under TRITON_INTERPRET=1, in float32 on CPU tensors.

Run as a script in a child process (test_triton_interpreter.py does that) because the variable must
be set before triton is imported and must not leak into other tests. Prints one JSON line:
{case: "ok" | "skip: why" | "fail: why"}. Importing this module imports neither torch nor triton.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

# (name, heads, kv heads, head dim, block size, query lens, context lens, forced decode partitions[, window])
CASES = [
    ("prefill_gqa2_block_crossing", 4, 2, 32, 4, [7, 9, 16], [0, 0, 0], None),
    ("prefill_prefix_hit", 4, 2, 32, 4, [5, 12, 3], [20, 7, 1], None),
    ("prefill_group3_padded_rows", 6, 2, 32, 8, [11, 2], [3, 30], None),
    ("prefill_mha_head_dim_24", 2, 2, 24, 4, [6, 10], [0, 5], None),
    ("prefill_group8", 8, 1, 16, 4, [9], [13], None),
    ("mixed_decode_and_prefill", 4, 2, 32, 4, [1, 6, 1, 9], [17, 0, 3, 22], None),
    ("mixed_with_split_decode", 6, 2, 16, 4, [1, 7, 1, 1], [40, 9, 2, 63], 3),
    ("decode_single_partition", 6, 2, 32, 4, [1, 1, 1, 1], [0, 3, 16, 40], None),
    ("decode_split_k_4", 4, 2, 32, 4, [1, 1, 1], [2, 47, 99], 4),
    ("decode_split_k_3_uneven", 6, 3, 16, 8, [1, 1], [70, 130], 3),
    # sliding-window layers: windows shorter and longer than the context, crossing key tiles
    ("window_prefill_fresh", 4, 2, 32, 4, [37, 9], [0, 0], None, 8),
    ("window_prefill_prefix_hit", 4, 2, 32, 4, [12, 5, 3], [40, 3, 17], None, 7),
    ("window_mixed", 6, 2, 16, 4, [1, 20, 1, 1], [50, 30, 5, 3], None, 10),
    ("window_decode_split_k_3", 4, 2, 32, 4, [1, 1, 1], [2, 47, 99], 3, 33),
    ("window_decode_split_k_5_long", 6, 3, 16, 8, [1, 1], [70, 130], 5, 17),
    ("window_1", 4, 2, 16, 4, [9, 1], [4, 20], None, 1),
]
CASE_NAMES = [c[0] for c in CASES] + ["write_kv_strided", "engine_greedy_tiny"]


def _batch(query_lens, context_lens, block_size, num_blocks, gen, device="cpu"):
    import torch

    from ferrylm.model.forward_batch import ForwardBatch

    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-(q + c) // block_size))] for q, c in zip(query_lens, context_lens)]
    return ForwardBatch.build([[1] * q for q in query_lens], context_lens, tables, block_size, device=device)


def run_case(heads, kv_heads, head_dim, block_size, query_lens, context_lens, parts, window=None, device="cpu",
             dtype=None, tol=1e-5) -> float:
    """Backend forward (KV write + attention) against the oracle; raises AssertionError on mismatch.

    `window`: a sliding-window layer's (a query at p sees keys p - window + 1 .. p), or None.
    The tolerance bounds the relative error ||got - want|| / ||want|| over the whole output.
    """
    import torch

    from ferrylm.model.attention.base import AttentionSpec
    from ferrylm.model.attention.torch_native import TorchNativeBackend
    from ferrylm.model.attention.triton import TritonBackend

    gen = torch.Generator().manual_seed(0)
    num_blocks = sum(-(-(q + c) // block_size) for q, c in zip(query_lens, context_lens)) + 3
    batch = _batch(query_lens, context_lens, block_size, num_blocks, gen, device)
    tokens = sum(query_lens)
    dtype = dtype or torch.float32
    # q, k, v as strided views of one packed projection, as llama.py hands them over after in-place RoPE
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(device, dtype)
    q, k, v = (t.view(tokens, -1, head_dim) for t in qkv.split([heads * head_dim, kv_heads * head_dim,
                                                                  kv_heads * head_dim], dim=-1))
    caches = [torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(device, dtype)
              for _ in range(2)]
    ref = [c.clone() for c in caches]
    spec = AttentionSpec(heads, kv_heads, head_dim, block_size, dtype, torch.device(device))
    triton_backend, oracle = TritonBackend(spec, parts), TorchNativeBackend()
    got = triton_backend.forward(q, k, v, caches[0], caches[1], batch.with_attn_metadata(triton_backend.prepare(batch)),
                                 head_dim ** -0.5, window)
    want = oracle.forward(q, k, v, ref[0], ref[1], batch.with_attn_metadata(oracle.prepare(batch)), head_dim ** -0.5,
                          window)
    assert torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1]), "KV cache differs"
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err < tol, f"relative error {err:.2e}"
    return err


def run_write_kv_strided() -> None:
    """K/V as strided views of a packed qkv projection, as llama.py hands them over."""
    import torch

    from ferrylm.model.attention import torch_native
    from ferrylm.model.attention.triton import write_kv

    gen = torch.Generator().manual_seed(1)
    tokens, heads, kv_heads, head_dim, block_size, num_blocks = 10, 4, 2, 16, 4, 8
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    _, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    k, v = k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    caches = [torch.zeros(num_blocks, block_size, kv_heads, head_dim) for _ in range(4)]
    write_kv(k, v, caches[0], caches[1], slots)
    torch_native.write_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3]), "KV cache differs"


def run_engine_greedy_tiny() -> None:
    """A tiny random model through the Engine (chunked prefill, mixed batches, decode): Triton == oracle."""
    import torch

    from tests.gpu.random_model import build_engine, build_runner, generate_greedy, model_config

    config = model_config("tiny", 256)
    prompts = [[5 + (7 * j) % 250 for j in range(11)], [9, 4, 2]]
    outputs = []
    for attention in ("torch", "triton"):
        runner = build_runner(config, device="cpu", dtype=torch.float32, num_blocks=32, max_model_len=256,
                              attention=attention, block_size=4)
        engine = build_engine(runner, 32, 256, max_num_seqs=4, max_num_batched_tokens=8, block_size=4)
        outputs.append(generate_greedy(engine, prompts, 6))
    assert outputs[0] == outputs[1], f"greedy tokens differ: {outputs}"


def _outcome(fn, *args) -> str:
    """ok, fail (our kernel or a mismatch), or skip when the error comes from inside triton itself."""
    try:
        fn(*args)
        return "ok"
    except AssertionError as e:
        return f"fail: {e}"
    except Exception as e:  # noqa: BLE001 - classify, never crash the whole run
        frames = traceback.extract_tb(e.__traceback__)
        inside_triton = bool(frames) and f"{os.sep}triton{os.sep}" in frames[-1].filename
        kind = "skip: the triton interpreter cannot run this kernel" if inside_triton else "fail"
        return f"{kind}: {type(e).__name__}: {e}"


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1 before running", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    results = {name: _outcome(run_case, *spec) for name, *spec in CASES}
    results["write_kv_strided"] = _outcome(run_write_kv_strided)
    os.environ.setdefault("FERRYLM_DISABLE_CPU_KERNELS", "1")  # the oracle engine: torch-native everywhere
    results["engine_greedy_tiny"] = _outcome(run_engine_greedy_tiny)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
