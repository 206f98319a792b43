"""Vectorised torch dequantisation of GGUF/ggml tensor data.

Block layouts follow ggml (llama.cpp) and are checked bit-for-bit against
``gguf.quants.dequantize``. The ``gguf`` package is deliberately *not*
imported here so this module works on machines without it.

Every decoder works on all blocks at once (no Python loop over blocks) and runs
on whatever device the input tensor lives on.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from enum import IntEnum
from typing import NamedTuple

import numpy as np
import torch

QK_K = 256  # elements per K-quant super-block


class GGMLType(IntEnum):
    """The ggml tensor type ids this module can dequantise (same ids as ggml)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30


# (elements per block, bytes per block), as in ggml's type traits.
BLOCK_SIZES: dict[GGMLType, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.BF16: (1, 2),
    GGMLType.Q4_0: (32, 2 + 16),
    GGMLType.Q4_1: (32, 2 + 2 + 16),
    GGMLType.Q8_0: (32, 2 + 32),
    GGMLType.Q4_K: (QK_K, 2 + 2 + 12 + QK_K // 2),
    GGMLType.Q5_K: (QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),
    GGMLType.Q6_K: (QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
}

SUPPORTED_TYPES: frozenset[GGMLType] = frozenset(BLOCK_SIZES)

# Names of other ggml types, only used to make error messages readable.
_OTHER_TYPE_NAMES: dict[int, str] = {
    6: "Q5_0", 7: "Q5_1", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 15: "Q8_K",
    16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL",
    21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32",
    27: "I64", 28: "F64", 29: "IQ1_M", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}


def _type_name(t: int) -> str:
    if t in GGMLType._value2member_map_:
        return GGMLType(t).name
    return _OTHER_TYPE_NAMES.get(t, "unknown")


def as_bytes(raw: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Flat uint8 view of ``raw``'s bytes (no copy where possible)."""
    if isinstance(raw, torch.Tensor):
        return raw.contiguous().reshape(-1).view(torch.uint8)
    arr = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if not arr.flags.writeable:
        # GGUFReader hands out read-only memmaps; we only ever read from them.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(arr)
    return torch.from_numpy(arr)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] uint8 -> [n, 1] float32 (copy first so the f16 view is aligned)."""
    return b.contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., k] uint8 -> [..., 2, k]: low nibbles then high nibbles."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=-2)


def _dequant_f32(data: torch.Tensor) -> torch.Tensor:
    """Plain float32: copy of the bytes."""
    return data.view(torch.float32).clone()


def _dequant_f16(data: torch.Tensor) -> torch.Tensor:
    """IEEE half precision."""
    return data.view(torch.float16).to(torch.float32)


def _dequant_bf16(data: torch.Tensor) -> torch.Tensor:
    """bfloat16: the top 16 bits of a float32 (bit-exact, NaN payloads kept)."""
    return (data.view(torch.int16).to(torch.int32) << 16).view(torch.float32)


def _dequant_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q8_0: f16 d, 32 x int8 q; x = q * d."""
    d = _f16(blocks[:, :2])
    return torch.mul(blocks[:, 2:].view(torch.int8), d)  # int8 * f32 -> f32, one pass


def _dequant_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_0: f16 d, 16 bytes of nibbles (low = elems 0..15, high = 16..31); x = (q - 8) * d."""
    d = _f16(blocks[:, :2])
    q = _nibbles(blocks[:, 2:]).reshape(-1, 32).view(torch.int8) - 8
    return torch.mul(q, d)


def _dequant_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_1: f16 d, f16 m, 16 bytes of nibbles; x = q * d + m."""
    d = _f16(blocks[:, :2])
    m = _f16(blocks[:, 2:4])
    q = _nibbles(blocks[:, 4:]).reshape(-1, 32)
    return torch.mul(q, d).add_(m)  # uint8 * f32 -> f32; separate add (no FMA) to stay exact


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte, 8 x (6-bit scale, 6-bit min) field (ggml get_scale_min_k4)."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def _k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sub-block scale and min ([n, 8, 1] each) for Q4_K / Q5_K."""
    d = _f16(blocks[:, 0:2])
    dmin = _f16(blocks[:, 2:4])
    sc, mn = _scale_min_k4(blocks[:, 4:16])
    return (d * sc.to(torch.float32)).unsqueeze(-1), (dmin * mn.to(torch.float32)).unsqueeze(-1)


def _dequant_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K: f16 d, f16 dmin, 12 B scales, 128 B nibbles; 8 sub-blocks of 32."""
    scale, mn = _k_scales(blocks)
    q = _nibbles(blocks[:, 16:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    return torch.mul(q, scale).sub_(mn).reshape(-1, QK_K)


def _dequant_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_K: as Q4_K plus 32 B of high bits (bit j of qh[i] -> sub-block j, elem i)."""
    scale, mn = _k_scales(blocks)
    qh = blocks[:, 16:48].unsqueeze(1)  # [n, 1, 32]
    shifts = torch.arange(8, dtype=torch.uint8, device=blocks.device).reshape(1, 8, 1)
    qh = (qh >> shifts) & 0x01  # [n, 8, 32]
    ql = _nibbles(blocks[:, 48:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    return torch.mul(ql | (qh << 4), scale).sub_(mn).reshape(-1, QK_K)


def _dequant_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K: 128 B low nibbles, 64 B 2-bit highs, 16 x int8 scales, f16 d; x = d * sc * (q - 32)."""
    ql = _nibbles(blocks[:, :128].reshape(-1, 2, 64)).reshape(-1, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=blocks.device).reshape(1, 1, 4, 1)
    qh = ((blocks[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 0x03).reshape(-1, 8, 32)
    q = (ql | (qh << 4)).view(torch.int8) - 32  # [-32, 31]
    scales = blocks[:, 192:208].view(torch.int8).to(torch.float32)
    d = _f16(blocks[:, 208:210]) * scales  # [n, 16]
    return torch.mul(q.reshape(-1, 16, 16), d.unsqueeze(-1)).reshape(-1, QK_K)


_DECODERS: dict[GGMLType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLType.F32: _dequant_f32,
    GGMLType.F16: _dequant_f16,
    GGMLType.BF16: _dequant_bf16,
    GGMLType.Q8_0: _dequant_q8_0,
    GGMLType.Q4_0: _dequant_q4_0,
    GGMLType.Q4_1: _dequant_q4_1,
    GGMLType.Q4_K: _dequant_q4_k,
    GGMLType.Q5_K: _dequant_q5_k,
    GGMLType.Q6_K: _dequant_q6_k,
}


def dequantize(
    raw: np.ndarray | torch.Tensor, ggml_type: int, shape: tuple[int, ...]
) -> torch.Tensor:
    """Dequantise ggml tensor data to a float32 tensor of logical ``shape``.

    ``raw`` holds the tensor's bytes (any dtype/shape; e.g. ``GGUFReader``'s
    ``tensor.data``). ``shape`` is the numpy-order shape (reversed GGUF dims);
    its last dimension must be a whole number of blocks. The result is on
    ``raw``'s device when ``raw`` is a torch tensor, else on the CPU.
    """
    t = int(ggml_type)
    if t not in GGMLType._value2member_map_ or GGMLType(t) not in SUPPORTED_TYPES:
        supported = ", ".join(x.name for x in sorted(SUPPORTED_TYPES))
        raise ValueError(
            f"unsupported GGML type {t} ({_type_name(t)}); supported: {supported}"
        )
    gt = GGMLType(t)
    block_size, type_size = BLOCK_SIZES[gt]
    shape = tuple(int(s) for s in shape)
    n_elems = math.prod(shape)
    if block_size > 1 and (not shape or shape[-1] % block_size != 0):
        raise ValueError(
            f"{gt.name}: last dimension of shape {shape} must be a multiple of "
            f"the block size {block_size}"
        )
    data = as_bytes(raw)
    expected = n_elems // block_size * type_size
    if data.numel() != expected:
        raise ValueError(
            f"{gt.name} tensor of shape {shape}: expected {expected} bytes, "
            f"got {data.numel()}"
        )
    if block_size > 1:
        data = data.reshape(-1, type_size)
    return _DECODERS[gt](data).reshape(shape)


class IntegerBlocks(NamedTuple):
    """A quantized tensor's integer codes and per-group affine terms: w = scale * codes + min.

    codes: [rows, cols] int16 in natural element order (values as stored: 0..15 for Q4_*, -128..127
    for Q8_0, 0..31 for Q5_K, -32..31 for Q6_K). scale / min: [rows, cols / group], fp16 where the
    file's own fp16 value is the scale (no rounding), else fp32 (products of fp16 and small ints, exact).
    min is None for symmetric formats.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None
    group: int


def _k_terms(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: per 32-element sub-block (scale, min) as fp32 [n, 8] (w = scale * q + min)."""
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mn = _scale_min_k4(blocks[:, 4:16])
    return d * sc.to(torch.float32), -(dmin * mn.to(torch.float32))


def _int_q4_0(b: torch.Tensor) -> IntegerBlocks:
    d = b[:, :2].contiguous().view(torch.float16)
    return IntegerBlocks(_nibbles(b[:, 2:]).reshape(-1, 32).to(torch.int16), d, d * -8, 32)


def _int_q4_1(b: torch.Tensor) -> IntegerBlocks:
    d, m = b[:, :2].contiguous().view(torch.float16), b[:, 2:4].contiguous().view(torch.float16)
    return IntegerBlocks(_nibbles(b[:, 4:]).reshape(-1, 32).to(torch.int16), d, m, 32)


def _int_q8_0(b: torch.Tensor) -> IntegerBlocks:
    return IntegerBlocks(b[:, 2:].view(torch.int8).to(torch.int16), b[:, :2].contiguous().view(torch.float16), None, 32)


def _int_q4_k(b: torch.Tensor) -> IntegerBlocks:
    scale, mn = _k_terms(b)
    q = _nibbles(b[:, 16:].reshape(-1, 4, 32)).reshape(-1, QK_K)
    return IntegerBlocks(q.to(torch.int16), scale, mn, 32)


def _int_q5_k(b: torch.Tensor) -> IntegerBlocks:
    scale, mn = _k_terms(b)
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device).reshape(1, 8, 1)
    qh = (b[:, 16:48].unsqueeze(1) >> shifts) & 0x01
    ql = _nibbles(b[:, 48:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    return IntegerBlocks((ql | (qh << 4)).reshape(-1, QK_K).to(torch.int16), scale, mn, 32)


def _int_q6_k(b: torch.Tensor) -> IntegerBlocks:
    ql = _nibbles(b[:, :128].reshape(-1, 2, 64)).reshape(-1, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).reshape(1, 1, 4, 1)
    qh = ((b[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 0x03).reshape(-1, 8, 32)
    q = (ql | (qh << 4)).reshape(-1, QK_K).to(torch.int16) - 32
    scale = _f16(b[:, 208:210]) * b[:, 192:208].view(torch.int8).to(torch.float32)  # [n, 16]
    return IntegerBlocks(q, scale, None, 16)


_INTEGER: dict[GGMLType, Callable[[torch.Tensor], IntegerBlocks]] = {
    GGMLType.Q4_0: _int_q4_0, GGMLType.Q4_1: _int_q4_1, GGMLType.Q8_0: _int_q8_0,
    GGMLType.Q4_K: _int_q4_k, GGMLType.Q5_K: _int_q5_k, GGMLType.Q6_K: _int_q6_k,
}
INTEGER_TYPES: frozenset[GGMLType] = frozenset(_INTEGER)


def integer_blocks(raw: np.ndarray | torch.Tensor, ggml_type: int, shape: tuple[int, int]) -> IntegerBlocks:
    """The integer codes and affine terms of a 2-D quantized tensor (no float weight is formed).

    Lossless: ``scale * codes + min`` equals ``dequantize(raw, ggml_type, shape)`` up to float rounding.
    """
    gt = GGMLType(int(ggml_type))
    if gt not in _INTEGER:
        raise ValueError(f"{gt.name} has no integer form (supported: {', '.join(t.name for t in _INTEGER)})")
    block_size, type_size = BLOCK_SIZES[gt]
    rows, cols = (int(s) for s in shape)
    data = as_bytes(raw)
    if cols % block_size or data.numel() != rows * cols // block_size * type_size:
        raise ValueError(f"{gt.name} tensor of shape {(rows, cols)}: {data.numel()} bytes do not fit")
    blocks = _INTEGER[gt](data.reshape(-1, type_size))
    per_row = cols // blocks.group
    return IntegerBlocks(blocks.codes.reshape(rows, cols), blocks.scale.reshape(rows, per_row),
                         None if blocks.min is None else blocks.min.reshape(rows, per_row), blocks.group)
