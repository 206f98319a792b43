"""Weights a quantized Linear keeps after loading, each with matmul / dequantize / embed.

PackedWeight is the CPU kernel's layout (layout.py): codes plus a scale (and min) per group. Its
dequantize() is the plain-torch twin every matmul path is tested against.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from ferrylm.model.quant.layout import dequantize_packed

if TYPE_CHECKING:
    from ferrylm.model.quant.base import StoredWeight

# Which path multiplies M activation rows (measured on SmolLM2 shapes, 30 layers + the LM head, 2
# threads, on this project's 2-core AMD EPYC (Zen 4): bench/packed_paths.py):
#   int8 activations (vnni_gemv.cpp, llama.cpp's arithmetic: x quantized to int8 per 32 elements, integer
#       dot products with AVX2 maddubs, AVX512-VNNI or NEON; each weight tile unpacked once per 8 rows and
#       kept in L1 for all of them), for bf16/fp16 activations up to INT8_M rows (INT8_M_AMX with AMX
#       tiles), and for fp32 ones under the int8 policy (--dtype auto on a CPU without BF16:
#       kernels.fp32_int8_gemv) up to INT8_FP32_M rows. An explicit float32 model takes the exact paths
#       below, so it stays exact against its dequantized twin. Measured, ms (int8 vs the path it
#       replaced): bf16 M=8 17.2 vs 16.9, M=16 31.2 vs 46.9 (panels), M=32 60.0 vs 59.2, M=64 119.7 vs
#       88.7: torch's native-BF16 GEMM wins from 32 rows; fp32 forced to AVX2 M=8 20.7 vs 31.3 (packed
#       kernel), M=32 83.9 vs 127.0, M=64 178.6 vs 377.5 (fp32 panels: 4 bytes written and read per
#       weight), M=128 360.5 vs 489.7, M=256 656 vs 693, M=512 1433 vs 1339;
#   M <= SMALL_M otherwise, or M <= FP32_KERNEL_M with fp32 activations: the packed kernel (exact
#       fp32 weights, FMAs; it reads W once per 8 rows: with fp32 activations it beats unpacking
#       fp32 panels for GEMM up to 32 rows, with bf16 ones AMX up to 6 rows, bench/packed_paths.py);
#   M <= AMX_M, bf16 activations, AMX present: 32 rows of W at a time unpacked to bf16 in cache and
#       multiplied on AMX tiles (faster than torch's bf16 GEMM there, and no bf16 weight in memory);
#   otherwise: panels of W unpacked to the activation dtype into a reused buffer, torch's GEMM.
INT8_M = 16
INT8_M_AMX = 8  # int8 vs AMX tiles between 8 and 64 rows: not measured (no AMX machine since); AMX kept
INT8_FP32_M = 128
SMALL_M = 6
FP32_KERNEL_M = 32
AMX_M = 64
# Rows of W unpacked per GEMM call on the last path (lm_head whole would be 56 MB per call).
PANEL_ROWS = 16384


class UnpackBuffer:
    """The scratch tensor the large-batch path unpacks weight panels into, shared by every layer of one
    model (layers run one at a time). Reusing it spares each step the page faults of fresh memory."""

    def __init__(self) -> None:
        self._flat: torch.Tensor | None = None

    def get(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        flat = self._flat
        if flat is None or flat.numel() < rows * cols or flat.dtype != dtype or flat.device != device:
            flat = self._flat = torch.empty(rows * cols, dtype=dtype, device=device)
        return flat[:rows * cols].view(rows, cols)


class PackedWeight(nn.Module):
    """W [out, in] as `codes` (uint8: q4 nibbles or int8) and `scales` / `mins` per `group` inputs.

    `kernels`: the compiled extension (quant/kernels.py) or None, then every call takes the twin.
    `buffer`: where the large-batch path unpacks panels (one per model; a private one if None).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group: int,
                 q4: bool, kernels=None, buffer: UnpackBuffer | None = None):
        super().__init__()
        self.buffer = buffer if buffer is not None else UnpackBuffer()
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.register_buffer("mins", None if mins is None else mins.contiguous())
        self.group, self.q4, self.kernels = group, q4, kernels
        self.out_features = codes.shape[0]
        self.in_features = codes.shape[1] * (2 if q4 else 1)

    def extra_repr(self) -> str:
        kind = "q4" if self.q4 else "q8"
        return (f"{kind}, out={self.out_features}, in={self.in_features}, group={self.group}, "
                f"scales={self.scales.dtype}, mins={self.mins is not None}, "
                f"kernel={self.kernels.variant if self.kernels is not None else None}, "
                f"int8_fp32={self.kernels is not None and self.kernels.fp32_int8_gemv}")

    def _kernel_ok(self, x: torch.Tensor) -> bool:
        return self.kernels is not None and x.is_cpu and self.in_features % 32 == 0

    def int8_rows(self, dtype: torch.dtype) -> int:
        """Up to how many activation rows of `dtype` take int8 activations (0: none)."""
        k = self.kernels
        if k is None or not k.has_vnni or self.in_features % 32 or \
                not (self.group == 32 or self.group % 64 == 0 or (self.group == 16 and not self.q4)):
            return 0
        if dtype == torch.float32:
            return INT8_FP32_M if k.fp32_int8_gemv else 0
        return INT8_M_AMX if k.has_amx else INT8_M

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in] → [M, out] in x's dtype."""
        if not self._kernel_ok(x):
            return F.linear(x, self.dequantize(x.dtype))
        m = x.shape[0]
        if m <= self.int8_rows(x.dtype):
            return self.kernels.quant_linear_vnni(x, self.codes, self.scales, self.mins, self.group, self.q4)
        if m <= SMALL_M or (m <= FP32_KERNEL_M and x.dtype == torch.float32):
            return self.kernels.quant_linear(x, self.codes, self.scales, self.mins, self.group, self.q4)
        if m <= AMX_M and x.dtype == torch.bfloat16 and self.kernels.has_amx:
            return self.kernels.quant_linear_amx(x, self.codes, self.scales, self.mins, self.group, self.q4)
        if self.out_features <= PANEL_ROWS:
            return F.linear(x, self._unpack(slice(None), x.dtype))
        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        for start in range(0, self.out_features, PANEL_ROWS):
            rows = slice(start, start + PANEL_ROWS)
            out[:, rows] = F.linear(x, self._unpack(rows, x.dtype))
        return out

    def _unpack(self, rows: slice, dtype: torch.dtype) -> torch.Tensor:
        codes = self.codes[rows]
        mins = None if self.mins is None else self.mins[rows]
        if torch.compiler.is_compiling():  # a traced graph allocates its own; no shared Python state
            return self.kernels.dequantize(codes, self.scales[rows], mins, self.group, self.q4, dtype)
        panel = self.buffer.get(codes.shape[0], self.in_features, dtype, codes.device)
        self.kernels.dequantize_into(codes, self.scales[rows], mins, self.group, self.q4, panel)
        return panel

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [out, in] (plain torch): scale * q + min per group."""
        return dequantize_packed(self.codes, self.scales, self.mins, self.group, self.q4).to(dtype)

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of W, unpacked: a tied embedding looks tokens up here (no float table kept)."""
        mins = None if self.mins is None else self.mins.index_select(0, ids)
        codes, scales = self.codes.index_select(0, ids), self.scales.index_select(0, ids)
        if self._kernel_ok(ids):
            return self.kernels.dequantize(codes, scales, mins, self.group, self.q4, dtype)
        return dequantize_packed(codes, scales, mins, self.group, self.q4).to(dtype)


class FloatWeight(nn.Module):
    """A plain float weight behind the same interface (a GGUF F16/F32 tensor inside a packed model)."""

    weight: torch.Tensor

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight.contiguous())
        self.out_features, self.in_features = weight.shape

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weight.to(dtype)

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return F.embedding(ids, self.weight).to(dtype)


class SegmentedWeight(nn.Module):
    """Row ranges of one Linear stored in different formats (a GGUF file that quantizes q, k and v of a
    packed qkv projection differently); outputs are concatenated along the output features."""

    def __init__(self, parts: Sequence[StoredWeight]):
        super().__init__()
        self.parts = nn.ModuleList(cast("Sequence[nn.Module]", parts))  # every StoredWeight is an nn.Module
        self.out_features = sum(p.out_features for p in parts)
        self.in_features = parts[0].in_features

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.matmul(x) for p in cast("Iterable[StoredWeight]", self.parts)], dim=-1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) for p in cast("Iterable[StoredWeight]", self.parts)], dim=0)

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return F.embedding(ids, self.dequantize(dtype))  # not a layout an embedding uses in practice
