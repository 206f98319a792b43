"""Loads the C++ CPU kernels as torch ops, built for the instruction-set variant this CPU runs best
(cpu_isa.py; kernel_build.py caches each build on disk).

The library registers `torch.ops.ferrylm_<variant>.{paged_decode_attention, add_rms_norm_, rope_qkv_,
write_kv_quant_}`
(TORCH_LIBRARY_FRAGMENT in csrc/paged_decode.cpp); their fake kernels, registered here, give
torch.compile the output shapes, so a compiled decode step traces through them as one graph.
If no compiler is available the build fails once and callers fall back to plain torch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import NamedTuple

import torch

from ferrylm.model.compile.op_fakes import register_fakes
from ferrylm.model.cpu.cpu_isa import BY_NAME, select_variant
from ferrylm.model.cpu.kernel_build import build_library, op_namespace

log = logging.getLogger("ferrylm.kernels")

_SOURCES = [Path(__file__).with_name("csrc") / name for name in ("paged_decode.cpp", "fused_ops.cpp")]
_CFLAGS = ("-ffast-math", "-fno-finite-math-only")


class CpuKernels(NamedTuple):
    """The ops, called like functions (each an OpOverload: one dispatcher hop, no Python wrapper)."""

    # (q, k_cache, v_cache, block_tables, seq_lens, scale, window=0): window > 0 attends the last `window` keys only
    paged_decode_attention: Callable[..., torch.Tensor]
    add_rms_norm_: Callable[..., None]  # (x, residual, weight, eps): x <- norm(x + residual), residual <- sum
    rope_qkv_: Callable[..., None]  # (qkv, positions, cos, sin, heads, head_dim), in place
    # (k, v, k_cache, v_cache, slot_mapping): quantize rows into an fp8 / int8 cache (kv_quant.py layout)
    write_kv_quant_: Callable[..., None]
    variant: str  # the cpu_isa variant these ops were built for


def _register_fakes(ns: str) -> None:
    """Shapes for tracing: attention returns q's shape; the in-place ops return nothing."""
    fakes: dict[str, Callable[..., torch.Tensor | None]] = {
        "paged_decode_attention": lambda q, k_cache, v_cache, block_tables, seq_lens, scale, window=0:
            torch.empty_like(q),
        "add_rms_norm_": lambda x, residual, weight, eps: None,
        "rope_qkv_": lambda qkv, positions, cos, sin, heads, head_dim: None,
        "write_kv_quant_": lambda k, v, k_cache, v_cache, slot_mapping: None,
    }
    register_fakes({f"{ns}::{name}": fake for name, fake in fakes.items()})


def load_cpu_kernels(variant: str | None = None) -> CpuKernels | None:
    """The ops of `variant` (default: FERRYLM_CPU_ISA or the best this CPU runs), or None if they
    cannot be built here (then torch-native is used)."""
    if os.environ.get("FERRYLM_DISABLE_CPU_KERNELS"):
        return None
    return _load(select_variant(forced=variant).name)


@cache
def _load(name: str) -> CpuKernels | None:
    variant = BY_NAME[name]
    try:
        build_library("ferrylm_cpu_ops", _SOURCES, variant, extra_cflags=_CFLAGS)
        ns = op_namespace(variant)
        _register_fakes(ns)
    except Exception as e:  # noqa: BLE001 - any build failure means "use the fallback"
        log.warning("CPU attention kernel (%s) unavailable, using plain torch: %s", name, e)
        return None
    ops = getattr(torch.ops, ns)
    return CpuKernels(ops.paged_decode_attention.default, ops.add_rms_norm_.default, ops.rope_qkv_.default,
                      ops.write_kv_quant_.default, name)
