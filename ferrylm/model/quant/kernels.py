"""Loads the C++ quantized-matmul kernels as torch ops (built once with torch's extension tools,
cached on disk): torch.ops.ferrylm.quant_* (TORCH_LIBRARY_FRAGMENT in csrc/quant_gemm.cpp). Their
fake kernels, registered here, give torch.compile the output shapes.

If they cannot be built here, callers fall back to plain torch (see packed.py).
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

_SOURCES = [Path(__file__).with_name("csrc") / name for name in ("quant_gemm.cpp", "amx_linear.cpp", "vnni_gemv.cpp")]


class QuantKernels(NamedTuple):
    """The ops (OpOverloads, called like functions) and whether AMX tiles run on this machine."""

    quant_linear: Callable[..., torch.Tensor]  # (x, codes, scales, mins, group, q4) -> [M, N]
    quant_linear_amx: Callable[..., torch.Tensor]  # same, bf16 x, M > a few rows
    quant_linear_vnni: Callable[..., torch.Tensor]  # same, M <= 4, x quantized to int8 per 32 (vnni_gemv.cpp)
    dequantize: Callable[..., torch.Tensor]  # (codes, scales, mins, group, q4, dtype) -> [N, K]
    dequantize_into: Callable[..., None]  # (codes, scales, mins, group, q4, out)
    has_amx: bool
    has_vnni: bool


def _register_fakes() -> None:
    def linear(x, codes, scales, mins, group_size, q4):
        return x.new_empty(x.shape[0], codes.shape[0])

    def dequantize(codes, scales, mins, group_size, q4, dtype):
        return codes.new_empty(codes.shape[0], codes.shape[1] * (2 if q4 else 1), dtype=dtype)

    fakes = {"ferrylm::quant_linear": linear, "ferrylm::quant_linear_amx": linear,
             "ferrylm::quant_linear_vnni": linear,
             "ferrylm::quant_dequantize": dequantize,
             "ferrylm::quant_dequantize_into": lambda codes, scales, mins, group_size, q4, out: None}
    register_fakes(fakes)


@lru_cache(maxsize=1)
def load_quant_kernels() -> QuantKernels | None:
    """The ops, or None if they cannot be built (or FERRYLM_DISABLE_QUANT_KERNELS is set)."""
    if os.environ.get("FERRYLM_DISABLE_QUANT_KERNELS"):
        return None
    try:
        from torch.utils.cpp_extension import load

        module = load(name="ferrylm_quant_ops", sources=[str(p) for p in _SOURCES],
                      extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
        _register_fakes()
    except Exception as e:  # noqa: BLE001 - any build failure means "use the fallback"
        log.warning("quantized matmul kernel unavailable, using plain torch: %s", e)
        return None
    ops = torch.ops.ferrylm
    return QuantKernels(ops.quant_linear.default, ops.quant_linear_amx.default, ops.quant_linear_vnni.default,
                        ops.quant_dequantize.default, ops.quant_dequantize_into.default, bool(module.has_amx()),
                        bool(module.has_vnni()))
