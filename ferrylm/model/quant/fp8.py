"""fp8 W8A8 (e4m3) on CUDA: weights quantized per output channel at load, activations per token at
run time, multiplied by torch._scaled_mm with row-wise scales. Needs compute capability 8.9+."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ferrylm.config import ConfigError
from ferrylm.model.quant.base import StoredWeightMethod

if TYPE_CHECKING:
    from ferrylm.model.arch.layers import Linear

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_fp8_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] → (fp8 [R, C], fp32 scales [R, 1]) with t ≈ scales * fp8, one scale per row."""
    t = t.float()
    scales = (t.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (t / scales).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scales


class Fp8Weight(nn.Module):
    weight_fp8: torch.Tensor  # [out, in] e4m3
    weight_scale: torch.Tensor  # [1, out] fp32

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        q, s = quantize_fp8_rows(weight)
        self.register_buffer("weight_fp8", q)
        self.register_buffer("weight_scale", s.reshape(1, -1).contiguous())  # [1, out]
        self.out_features, self.in_features = weight.shape

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        xq, xs = quantize_fp8_rows(x)
        return torch._scaled_mm(xq, self.weight_fp8.t(), scale_a=xs, scale_b=self.weight_scale,
                                out_dtype=x.dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.weight_fp8.float() * self.weight_scale.t()).to(dtype)

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return F.embedding(ids, self.dequantize(dtype))


class Fp8W8A8(StoredWeightMethod):
    """--quantization fp8."""

    name = "fp8"

    def __init__(self, device: torch.device):
        if device.type != "cuda":
            raise ConfigError(f"--quantization fp8 needs a CUDA GPU (torch._scaled_mm); the device is {device}. "
                              "On the CPU use --quantization int8 or int4")
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ConfigError(f"--quantization fp8 needs compute capability 8.9 or newer, this GPU has {major}.{minor}")

    def create_weights(self, layer: Linear) -> None:
        if layer.in_features % 16 or layer.out_features % 16:
            raise ConfigError(f"--quantization fp8: torch._scaled_mm needs in/out features divisible by 16, "
                              f"got {layer.in_features}→{layer.out_features}")
        super().create_weights(layer)

    def process_weights_after_loading(self, layer: Linear) -> None:
        self.replace_weight(layer, Fp8Weight(layer.weight.data))
