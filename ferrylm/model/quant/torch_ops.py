"""Weight-only int8 / int4 on torch's own fused CPU ops: the path when the C++ kernel does not build.

int8: torch._weight_int8pack_mm (per output channel). int4: torch._weight_int4pack_mm_for_cpu, whose
dequantization is w = (q - 8) * scale + zero (checked numerically in tests/model/test_quant.py), so a
group's (scale, min) pair maps onto it as zero = min + 8 * scale.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ferrylm.model.quant.layout import dequantize_packed, pack_q4


class TorchInt8Weight(nn.Module):
    """int8 codes [out, in] and one fp32 scale per output row."""

    codes: torch.Tensor
    scales: torch.Tensor

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor):
        super().__init__()
        self.register_buffer("codes", codes.contiguous())  # int8
        self.register_buffer("scales", scales.reshape(-1).float().contiguous())
        self.out_features, self.in_features = codes.shape

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            return F.linear(x, self.dequantize(x.dtype))
        return torch._weight_int8pack_mm(x.contiguous(), self.codes, self.scales.to(x.dtype))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.codes.float() * self.scales[:, None]).to(dtype)

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (self.codes.index_select(0, ids).float() * self.scales[ids, None]).to(dtype)


class TorchInt4Weight(nn.Module):
    """4-bit codes 0..15 in torch's CPU int4 pack, with (scale, zero) per group in fp32."""

    packed: torch.Tensor
    scale_zeros: torch.Tensor
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group: int):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.group = group
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1))
        zeros = mins.float() + 8 * scales.float()
        self.register_buffer("scale_zeros", torch.stack((scales.float().t(), zeros.t()), dim=-1).contiguous())
        # the codes again in the kernel layout, for dequantize() / embed() (the twin)
        self.register_buffer("codes", pack_q4(q))
        self.register_buffer("scales", scales.contiguous())
        self.register_buffer("mins", mins.contiguous())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            return F.linear(x, self.dequantize(x.dtype))
        return torch._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, self.group,
                                                 self.scale_zeros.to(x.dtype))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_packed(self.codes, self.scales, self.mins, self.group, True).to(dtype)

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_packed(self.codes.index_select(0, ids), self.scales.index_select(0, ids),
                                 self.mins.index_select(0, ids), self.group, True).to(dtype)
