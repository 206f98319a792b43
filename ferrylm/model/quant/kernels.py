"""Loads the C++ quantized-matmul kernels as torch ops, built for the instruction-set variant this CPU
runs best (cpu_isa.py; kernel_build.py caches each build on disk): torch.ops.ferrylm_<variant>.quant_*
(TORCH_LIBRARY_FRAGMENT in csrc/quant_gemm.cpp). Their fake kernels, registered here, give
torch.compile the output shapes.

If they cannot be built here, callers fall back to plain torch (see packed.py).
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

_SOURCES = [Path(__file__).with_name("csrc") / name
            for name in ("quant_gemm.cpp", "amx_linear.cpp", "vnni_gemv.cpp", "moe_experts.cpp")]


class QuantKernels(NamedTuple):
    """The ops (OpOverloads, called like functions) and whether AMX tiles run on this machine."""

    quant_linear: Callable[..., torch.Tensor]  # (x, codes, scales, mins, group, q4) -> [M, N]
    quant_linear_amx: Callable[..., torch.Tensor]  # same, bf16 x, M > a few rows
    quant_linear_vnni: Callable[..., torch.Tensor]  # same, M <= 8, x quantized to int8 per 32 (vnni_gemv.cpp)
    dequantize: Callable[..., torch.Tensor]  # (codes, scales, mins, group, q4, dtype) -> [N, K]
    dequantize_into: Callable[..., None]  # (codes, scales, mins, group, q4, out)
    has_amx: bool
    has_vnni: bool  # quant_linear_vnni runs here (int8 activations: AVX512-VNNI or AVX2 maddubs)
    variant: str  # the cpu_isa variant these ops were built for
    # an MoE layer's routed experts in one call (x, logits, top_k, routing, slots, gate_up codes, scales,
    # mins, group, q4, down codes, scales, mins, group, q4) -> [T, H]; None where not built (moe_experts.cpp)
    moe_experts_int8: Callable[..., torch.Tensor] | None = None
    fp32_int8_gemv: bool = False  # policy: fp32 decode rows take quant_linear_vnni too (select_quant_method)


def _register_fakes(ns: str) -> None:
    def linear(x, codes, scales, mins, group_size, q4):
        return x.new_empty(x.shape[0], codes.shape[0])

    def dequantize(codes, scales, mins, group_size, q4, dtype):
        return codes.new_empty(codes.shape[0], codes.shape[1] * (2 if q4 else 1), dtype=dtype)

    def moe_experts(x, *args):
        return torch.empty_like(x)

    fakes = {"quant_linear": linear, "quant_linear_amx": linear, "quant_linear_vnni": linear,
             "quant_moe_experts_int8": moe_experts, "quant_dequantize": dequantize,
             "quant_dequantize_into": lambda codes, scales, mins, group_size, q4, out: None}
    register_fakes({f"{ns}::{name}": fake for name, fake in fakes.items()})


def load_quant_kernels(variant: str | None = None) -> QuantKernels | None:
    """The ops of `variant` (default: FERRYLM_CPU_ISA or the best this CPU runs), or None if they
    cannot be built (or FERRYLM_DISABLE_QUANT_KERNELS is set)."""
    if os.environ.get("FERRYLM_DISABLE_QUANT_KERNELS"):
        return None
    return _load(select_variant(forced=variant).name)


@cache
def _load(name: str) -> QuantKernels | None:
    variant = BY_NAME[name]
    try:
        build_library("ferrylm_quant_ops", _SOURCES, variant)
        ns = op_namespace(variant)
        _register_fakes(ns)
    except Exception as e:  # noqa: BLE001 - any build failure means "use the fallback"
        log.warning("quantized matmul kernel (%s) unavailable, using plain torch: %s", name, e)
        return None
    ops = getattr(torch.ops, ns)
    return QuantKernels(ops.quant_linear.default, ops.quant_linear_amx.default, ops.quant_linear_vnni.default,
                        ops.quant_dequantize.default, ops.quant_dequantize_into.default, bool(ops.quant_has_amx()),
                        bool(ops.quant_has_vnni()), name,
                        ops.quant_moe_experts_int8.default if ops.quant_has_moe_experts() else None)
