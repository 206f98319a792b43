"""Loads the C++ CPU kernels (built once with torch's extension tools, cached on disk) as torch ops.

The library registers `torch.ops.ferrylm.{paged_decode_attention, add_rms_norm_, rope_qkv_,
write_kv_quant_}`
(TORCH_LIBRARY_FRAGMENT in csrc/paged_decode.cpp); their fake kernels, registered here, give
torch.compile the output shapes, so a compiled decode step traces through them as one graph.
If no compiler is available the build fails once and callers fall back to plain torch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import torch

from ferrylm.model.op_fakes import register_fakes

log = logging.getLogger("ferrylm.kernels")

_SOURCES = [Path(__file__).with_name("csrc") / name for name in ("paged_decode.cpp", "fused_ops.cpp")]
_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp"]


class CpuKernels(NamedTuple):
    """The ops, called like functions (each an OpOverload: one dispatcher hop, no Python wrapper)."""

    paged_decode_attention: Callable[..., torch.Tensor]  # (q, k_cache, v_cache, block_tables, seq_lens, scale)
    add_rms_norm_: Callable[..., None]  # (x, residual, weight, eps): x <- norm(x + residual), residual <- sum
    rope_qkv_: Callable[..., None]  # (qkv, positions, cos, sin, heads, head_dim), in place
    # (k, v, k_cache, v_cache, slot_mapping): quantize rows into an fp8 / int8 cache (kv_quant.py layout)
    write_kv_quant_: Callable[..., None]


def _register_fakes() -> None:
    """Shapes for tracing: attention returns q's shape; the in-place ops return nothing."""
    fakes = {
        "ferrylm::paged_decode_attention": lambda q, k_cache, v_cache, block_tables, seq_lens, scale:
            torch.empty_like(q),
        "ferrylm::add_rms_norm_": lambda x, residual, weight, eps: None,
        "ferrylm::rope_qkv_": lambda qkv, positions, cos, sin, heads, head_dim: None,
        "ferrylm::write_kv_quant_": lambda k, v, k_cache, v_cache, slot_mapping: None,
    }
    register_fakes(fakes)


@lru_cache(maxsize=1)
def load_cpu_kernels() -> CpuKernels | None:
    """The ops, or None if they cannot be built here (then torch-native is used)."""
    if os.environ.get("FERRYLM_DISABLE_CPU_KERNELS"):
        return None
    try:
        from torch.utils.cpp_extension import load

        load(name="ferrylm_cpu_ops", sources=[str(p) for p in _SOURCES], extra_cflags=_CFLAGS,
             extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
        _register_fakes()
    except Exception as e:  # noqa: BLE001 - any build failure means "use the fallback"
        log.warning("CPU attention kernel unavailable, using plain torch: %s", e)
        return None
    ops = torch.ops.ferrylm
    return CpuKernels(ops.paged_decode_attention.default, ops.add_rms_norm_.default, ops.rope_qkv_.default,
                      ops.write_kv_quant_.default)
