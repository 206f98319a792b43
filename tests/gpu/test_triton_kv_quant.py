"""Triton kernels on quantized KV caches (--kv-cache-dtype fp8 e4m3 / int8) without a GPU:

- under the interpreter (TRITON_INTERPRET=1, a child process running this file as a script, as
  test_triton_interpreter.py does): the quantizing write kernel against kv_quant's (int8 scales
  equal, codes within one step; fp8 codes within one step but for the interpreter's own
  conversion bug, see _assert_fp8_codes_equal), then prefill and split-K decode on identical quantized caches against
  TorchNativeBackend, within 1e-4 relative (float32 queries);
- lowered to sm_90 cubins (as test_triton_compile.py does) for the bf16 serving path with int8,
  e4m3 and e5m2 caches: the real compiler accepts what the interpreter ran.

e5m2 runs on GPU only: the interpreter's fp32 -> e5m2 conversion does not round like torch's.
Nothing here ran on a GPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# (name, heads, kv heads, head dim, block size, query lens, context lens, forced decode partitions)
CASES = [
    ("prefill_prefix_hit", 4, 2, 32, 4, [5, 12, 3], [20, 7, 1], None),
    ("mixed_with_split_decode", 6, 2, 16, 4, [1, 7, 1, 1], [40, 9, 2, 63], 3),
    ("decode_single_partition", 6, 2, 32, 4, [1, 1, 1, 1], [0, 3, 16, 40], None),
]
DTYPES = ["float8_e4m3fn", "int8"]
CASE_NAMES = [f"{name}-{dtype}" for name, *_ in CASES for dtype in DTYPES]

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def run_case(heads, kv_heads, head_dim, block_size, query_lens, context_lens, parts, dtype_name) -> float:
    """Triton forward vs the oracle on quantized caches; raises AssertionError on a mismatch."""
    import torch

    from ferrylm.model.attention import kv_quant
    from ferrylm.model.attention.base import AttentionSpec
    from ferrylm.model.attention.torch_native import TorchNativeBackend, write_kv
    from ferrylm.model.attention.triton import TritonBackend, paged_decode, paged_prefill
    from ferrylm.model.attention.triton import write_kv as triton_write
    from tests.gpu.interpreter_cases import _batch

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(0)
    num_blocks = sum(-(-(q + c) // block_size) for q, c in zip(query_lens, context_lens)) + 3
    batch = _batch(query_lens, context_lens, block_size, num_blocks, gen)
    tokens = sum(query_lens)
    q, k, v = (torch.randn(tokens, n, head_dim, generator=gen) for n in (heads, kv_heads, kv_heads))
    k[..., 0] *= 12.0  # an outlier channel, as real K has
    shape = (num_blocks, block_size, kv_heads, head_dim)
    caches, ref = ([kv_quant.allocate(shape, dtype, "cpu") for _ in range(2)] for _ in range(2))
    history = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen)
    for pair in (caches, ref):
        write_kv(history, history / 3, pair[0], pair[1], torch.arange(num_blocks * block_size))
    spec = AttentionSpec(heads, kv_heads, head_dim, block_size, torch.float32, torch.device("cpu"))
    backend, oracle = TritonBackend(spec, parts), TorchNativeBackend()
    triton_write(k, v, caches[0], caches[1], batch.slot_mapping)
    write_kv(k, v, ref[0], ref[1], batch.slot_mapping)
    for c, r in zip(caches, ref):
        assert torch.equal(kv_quant.scales(c), kv_quant.scales(r)), "scales differ"
        if dtype == torch.int8:
            assert (c.int() - r.int()).abs().max() <= 1, "int8 codes differ by more than one step"
        else:
            _assert_fp8_codes_equal(c, r)
        c.untyped_storage().copy_(r.untyped_storage())  # attention below reads identical caches
    meta = backend.prepare(batch)
    got = torch.empty_like(q)
    if meta.plan is not None:
        paged_prefill(q, caches[0], caches[1], batch, meta.plan, head_dim ** -0.5, backend.cfg, got)
    if meta.num_decode:
        paged_decode(q, caches[0], caches[1], batch, head_dim ** -0.5, meta.decode_partitions, backend.cfg, got,
                     meta.plan)
    want = oracle.forward(q, k, v, ref[0], ref[1], batch.with_attn_metadata(oracle.prepare(batch)), head_dim ** -0.5)
    err = ((got - want).norm() / want.norm()).item()
    assert err < 1e-4, f"relative error {err:.2e}"
    return err


def _assert_fp8_codes_equal(got, want) -> None:
    """Codes within one step of kv_quant's, or where the interpreter's fp32 -> e4m3 conversion drops
    a rounding carry into the next exponent (1.96 becomes 1.0, not 2.0: half of torch's power of
    two). The interpreter rounds differently from round-to-nearest-even (subnormals too), so equal
    codes are not asserted here; on a GPU the conversion is the hardware's RNE, as torch's."""
    import torch

    g_bits, w_bits = got.view(torch.uint8).int(), want.view(torch.uint8).int()
    near = ((g_bits & 0x80) == (w_bits & 0x80)) & ((g_bits & 0x7F) - (w_bits & 0x7F)).abs().le(1)
    g, w = got.float(), want.float()
    carry = (g * 2 == w) & (torch.frexp(w.abs()).mantissa == 0.5)
    bad = ~(near | carry)
    assert not bad.any(), f"fp8 codes differ: {g[bad][:4].tolist()} vs {w[bad][:4].tolist()}"
    assert near.float().mean() > 0.9


def _main() -> None:
    """Run every case (TRITON_INTERPRET=1 must already be set); print {case: "ok" | "fail: why"}."""
    results = {}
    for name, *args in CASES:
        for dtype in DTYPES:
            try:
                run_case(*args, dtype)
                results[f"{name}-{dtype}"] = "ok"
            except Exception as e:  # noqa: BLE001 - reported per case
                results[f"{name}-{dtype}"] = f"fail: {e!r}\n{traceback.format_exc()[-1500:]}"
    print(json.dumps(results))


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(Path(__file__))], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=240)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        pytest.fail(f"interpreter run failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


@needs_triton
@pytest.mark.parametrize("case", CASE_NAMES)
def test_quantized_cache_matches_oracle_under_interpreter(interpreter_results, case):
    assert interpreter_results[case] == "ok", interpreter_results[case]


@needs_triton
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1: kernels are interpreted")
@pytest.mark.parametrize("cache", ["i8", "fp8e4nv", "fp8e5"])
def test_quantized_kernels_compile_for_sm90(cache):
    """The bf16 serving path (Llama-3 shapes) with a quantized cache: cache pointers typed as the
    codes, scale pointers fp16 (int8 rows) or fp32 (fp8 per tensor)."""
    from ferrylm.model.attention import triton as kernels
    from tests.gpu.test_triton_compile import SHAPES, _compile, _configs, _signature

    cfg, tiles = _configs(SHAPES["llama3"], fp32=False)
    scale = "*fp16" if cache == "i8" else "*fp32"
    typed = {"k_cache_ptr": f"*{cache}", "v_cache_ptr": f"*{cache}", "k_scale_ptr": scale, "v_scale_ptr": scale}

    def build(kernel, constexprs, num_warps=4):
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        sig = {**_signature(kernel, "bf16", constexprs), **typed}
        try:
            return triton.compile(ASTSource(kernel, sig, constexprs), target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": num_warps, "num_stages": 2})
        except (ImportError, RuntimeError, FileNotFoundError) as e:
            if "ptxas" in str(e) or "backend" in str(e).lower():
                pytest.skip(f"no NVIDIA compiler backend in this triton build: {e}")
            raise

    assert _compile is not None  # the plain kernels: test_triton_compile.py
    build(kernels._write_kv_kernel, cfg["write_kv"])
    build(kernels._prefill_kernel, cfg["prefill"], tiles.prefill_warps)
    for gather in (False, True):
        build(kernels._decode_kernel, {**cfg["decode"], "GATHER": gather}, tiles.decode_warps)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _main()
