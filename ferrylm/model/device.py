"""Device and dtype choices: bfloat16 where the hardware computes it natively, float32 elsewhere."""

from __future__ import annotations

import torch

from ferrylm.model.cpu.cpu_isa import select_variant

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def cpu_has_bf16() -> bool:
    """True when the kernel variant in use (cpu_isa.py: the best the CPU reports, or FERRYLM_CPU_ISA)
    computes bf16 natively (AVX512-BF16 or AMX), where bf16 GEMMs run ~2x faster than fp32. A forced
    lower variant (avx2) therefore also gets the fp32 activations an AVX2-only machine gets."""
    return bool({"avx512_bf16", "amx_bf16"} & select_variant().requires)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """Map a --dtype flag to a torch dtype; 'auto' picks bf16 on CUDA and on BF16-capable CPUs."""
    if dtype == "auto":
        if device.type == "cuda" or cpu_has_bf16():
            return torch.bfloat16
        return torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, float32, bfloat16 or float16")
    return DTYPES[dtype]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)
