"""The packed weight layouts the CPU kernel reads (quant/csrc/quant_gemm.cpp), in plain torch.

q4: 4-bit codes 0..15, 16 bytes per 32 elements: byte i holds element i in its low nibble and element
i + 16 in its high nibble (ggml's Q4_0 / Q4_1 order). q8: int8 codes in natural order. Both with a
scale (and optionally a min) per group: w = scale * q + min.
"""

from __future__ import annotations

import torch


def pack_q4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0..15 (any integer dtype, K a multiple of 32) → [N, K/2] uint8."""
    n, k = q.shape
    if k % 32:
        raise ValueError(f"4-bit packing needs in_features divisible by 32, got {k}")
    blocks = q.to(torch.uint8).reshape(n, k // 32, 32)
    return (blocks[..., :16] | (blocks[..., 16:] << 4)).reshape(n, k // 2).contiguous()


def unpack_q4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_q4: [N, K/2] uint8 → [N, K] uint8 codes 0..15."""
    n, half = packed.shape
    blocks = packed.reshape(n, half // 16, 16)
    return torch.cat((blocks & 0x0F, blocks >> 4), dim=-1).reshape(n, half * 2)


def expand_groups(t: torch.Tensor, group: int) -> torch.Tensor:
    """[N, K/group] → [N, K] float32, each group's value repeated over its elements."""
    return t.float().repeat_interleave(group, dim=1)


def dequantize_packed(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group: int,
                      q4: bool) -> torch.Tensor:
    """The float32 weight [N, K] a packed layout stands for: scale * q + min per group."""
    q = unpack_q4(codes).float() if q4 else codes.view(torch.int8).float()
    w = q * expand_groups(scales, group)
    return w + expand_groups(mins, group) if mins is not None else w
