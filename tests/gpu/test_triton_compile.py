"""Compile every Triton kernel ahead of time for an H100/H200 (sm_90) without a GPU.

The interpreter runs kernels as numpy and accepts code the real compiler rejects (loop-carried type
changes, dot shapes below 16, non-constexpr globals); this lowers each kernel to a cubin with the
ptxas bundled in the triton wheel, for the configurations the GPU path launches.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import tempfile
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from ferrylm.model.attention.triton import TileConfig

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1: kernels are interpreted"),
]

# kernel constexprs for SmolLM2 (9 heads / 3 KV heads, head dim 64) and Llama-3 (32 / 8, 128)
SHAPES = {"smollm2": dict(heads=9, kv_heads=3, head_dim=64), "llama3": dict(heads=32, kv_heads=8, head_dim=128)}
FLOATS = {"scale_log2"}
INT64_PTRS = {"slot_ptr", "tables_ptr", "seq_lens_ptr", "query_start_ptr"}
INT32_PTRS = {"tiles_ptr", "rows_ptr"}
FP32_PTRS = {"part_ptr"}


def _signature(kernel, dtype: str, constexprs: dict) -> dict[str, str]:
    """Argument types as triton.compile wants them: pointers typed by role, scalars i32 / fp32."""
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = ("*i64" if name in INT64_PTRS else "*i32" if name in INT32_PTRS
                         else "*fp32" if name in FP32_PTRS else f"*{dtype}")
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
    return sig


def _compile(kernel, dtype: str, constexprs: dict, num_warps: int = 4, num_stages: int = 2):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    try:
        target = GPUTarget("cuda", 90, 32)
        src = ASTSource(kernel, _signature(kernel, dtype, constexprs), constexprs)
        return triton.compile(src, target=target, options={"num_warps": num_warps, "num_stages": num_stages})
    except (ImportError, RuntimeError, FileNotFoundError) as e:
        if "ptxas" in str(e) or "backend" in str(e).lower():
            pytest.skip(f"no NVIDIA compiler backend in this triton build: {e}")
        raise


def _spill_bytes(compiled) -> int | None:
    """Spill stores ptxas reports for the kernel's PTX (None when the bundled ptxas is missing)."""
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(compiled.asm["ptx"])
        report = subprocess.run([ptxas, "-v", "-arch=sm_90a", path, "-o", os.devnull], capture_output=True,
                                text=True).stderr
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", report))


def _configs(shape: dict, fp32: bool) -> tuple[dict, "TileConfig"]:
    """Constexprs as TritonBackend's launches pass them, and the tile config (warps)."""
    import torch

    from ferrylm.model.attention.triton import TileConfig, _block_q, _pow2

    group = shape["heads"] // shape["kv_heads"]
    tiles = TileConfig.for_gpu(shape["head_dim"], torch.float32 if fp32 else torch.bfloat16, 132)
    common = dict(HEAD_DIM=shape["head_dim"], BLOCK_SIZE=16, D_PAD=_pow2(shape["head_dim"], 16))
    flags = dict(UPCAST=False, DOT_PREC="ieee" if fp32 else "tf32")
    return {
        "write_kv": dict(NUM_KV_HEADS=shape["kv_heads"], HKV_PAD=_pow2(shape["kv_heads"]), **common),
        "prefill": dict(GROUP=group, G_PAD=_pow2(group), BLOCK_Q=_block_q(group, tiles), BLOCK_N=tiles.prefill_keys,
                        **common, **flags),
        "decode": dict(NUM_HEADS=shape["heads"], GROUP=group, G_PAD=_pow2(group, 16), BLOCK_N=tiles.decode_keys,
                       **common, **flags),
        "reduce": dict(NUM_HEADS=shape["heads"], HEAD_DIM=shape["head_dim"], D_PAD=common["D_PAD"]),
    }, tiles


@pytest.mark.parametrize("shape,dtype", [("llama3", "bf16"), ("smollm2", "fp32")])  # serving path, parity path
def test_kernels_compile_for_sm90(shape: str, dtype: str) -> None:
    from ferrylm.model.attention import triton as kernels

    cfg, tiles = _configs(SHAPES[shape], dtype == "fp32")
    _compile(kernels._write_kv_kernel, dtype, cfg["write_kv"])
    prefill, decode = [], []
    for window in (False, True):  # full-context layers, sliding-window layers (Gemma 3)
        prefill.append(_compile(kernels._prefill_kernel, dtype, {**cfg["prefill"], "HAS_WINDOW": window},
                                num_warps=tiles.prefill_warps))
        assert prefill[-1].metadata.shared <= 227 * 1024, "prefill tile exceeds H100/H200 shared memory"
        decode += [_compile(kernels._decode_kernel, dtype, {**cfg["decode"], "GATHER": gather, "HAS_WINDOW": window},
                            num_warps=tiles.decode_warps) for gather in (False, True)]
    for gather in (False, True):
        _compile(kernels._reduce_kernel, dtype, {**cfg["reduce"], "GATHER": gather})
    if dtype == "bf16":  # the serving path: tiles were sized so that nothing spills to local memory
        assert all(_spill_bytes(k) in (0, None) for k in prefill + decode)
