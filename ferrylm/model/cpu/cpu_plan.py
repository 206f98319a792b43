"""What `--dtype auto` and the kernel loader pick for this machine, and the one log line that says why.

- activations: bfloat16 where the CPU computes it natively (AVX512-BF16 or AMX), float32 elsewhere
  (emulated bf16 GEMMs were the slowest configuration on AVX2-only CPUs);
- kernels: the best instruction-set variant the CPU reports (cpu_isa.py), FERRYLM_CPU_ISA to force;
- decode GEMVs of packed weights: int8-quantized activations (llama.cpp's arithmetic) under
  --dtype auto; an explicit --dtype float32 keeps every matmul exact against the dequantized twin;
- threads: one per physical core this process may use (cpu_threads.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ferrylm.model.cpu.cpu_isa import CpuInfo, select_variant, this_cpu
from ferrylm.model.device import cpu_has_bf16, resolve_dtype


class CpuPlan(NamedTuple):
    cpu: CpuInfo
    variant: str
    dtype: torch.dtype
    int8_activations: bool
    threads: int

    def describe(self) -> str:
        native = "native BF16" if cpu_has_bf16() else "no native BF16"
        gemv = "int8-quantized activations" if self.int8_activations else "exact fp32/bf16 activations"
        dtype = str(self.dtype).removeprefix("torch.")
        return (f"CPU {self.cpu.model or self.cpu.arch} ({self.cpu.arch}, {native}): {self.variant} kernels "
                f"(best supported: {self.cpu.supported()[-1].name}), activations {dtype}, "
                f"decode GEMV with {gemv}, {self.threads} threads")


def plan_cpu(dtype_flag: str, threads: int) -> CpuPlan:
    """The choices for a CPU model run with --dtype `dtype_flag` on `threads` threads."""
    cpu = this_cpu()
    dtype = resolve_dtype(dtype_flag, torch.device("cpu"))
    return CpuPlan(cpu, select_variant(cpu).name, dtype, dtype_flag == "auto", threads)
