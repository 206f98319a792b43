"""int8 / int4 weight-only quantization of float checkpoints, done once at load time.

int8: symmetric, one scale per output channel (w = s * q, q in -127..127).
int4: asymmetric min-max per group of `group` inputs (w = s * q + min, q in 0..15), the same
arithmetic as GGUF's Q4_1, so it runs on the same kernel. Scales and mins are stored in fp16. The LM
head (and a tied embedding) gets int8 instead: see Int4WeightOnly.lm_head_method.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ferrylm.config import ConfigError
from ferrylm.model.quant.base import StoredWeightMethod
from ferrylm.model.quant.layout import pack_q4
from ferrylm.model.quant.packed import PackedWeight, UnpackBuffer
from ferrylm.model.quant.torch_ops import TorchInt4Weight, TorchInt8Weight

if TYPE_CHECKING:
    from ferrylm.model.arch.layers import Linear


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float → (int8 codes [N, K], fp32 scales [N, 1]) with w ≈ scales * codes."""
    w = w.float()
    scales = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.round(w / scales).clamp_(-127, 127).to(torch.int8), scales


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float → (codes 0..15 uint8 [N, K], fp16 scales and mins [N, K / group]).

    Codes are rounded against the fp16-rounded scale and min, so dequantization sees the same values.
    """
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scales = ((hi - lo) / 15).clamp(min=2.0 ** -24).half()
    mins = lo.half()
    q = torch.round((g - mins.float()[..., None]) / scales.float()[..., None]).clamp_(0, 15)
    return q.to(torch.uint8).reshape(n, k), scales, mins


class Int8WeightOnly(StoredWeightMethod):
    """int8 weights per output channel; the C++ kernel, else torch._weight_int8pack_mm."""

    name = "int8"

    def __init__(self, kernels=None):
        self.kernels, self.buffer = kernels, UnpackBuffer()

    def process_weights_after_loading(self, layer: Linear) -> None:
        codes, scales = quantize_int8(layer.weight.data)
        k = codes.shape[1]
        packed: PackedWeight | TorchInt8Weight
        if self.kernels is not None and k % 32 == 0:
            packed = PackedWeight(codes.view(torch.uint8), scales, None, k, False, self.kernels, self.buffer)
        else:
            packed = TorchInt8Weight(codes, scales)
        self.replace_weight(layer, packed)


class Int4WeightOnly(StoredWeightMethod):
    """int4 weights, group-wise asymmetric; the C++ kernel, else torch._weight_int4pack_mm_for_cpu."""

    name = "int4"

    def __init__(self, group: int, kernels=None):
        self.group, self.kernels, self.buffer = group, kernels, UnpackBuffer()

    def lm_head_method(self) -> StoredWeightMethod:
        """int8 per channel for the LM head: measured on SmolLM2 (tests/model/test_quant_perplexity.py),
        a 4-bit head cost +6.8% perplexity, an int8 one none; it is also the tied embedding table."""
        return Int8WeightOnly(self.kernels)

    def create_weights(self, layer: Linear) -> None:
        if layer.in_features % self.group:
            raise ConfigError(f"--quantization int4 with group size {self.group}: it does not divide "
                              f"in_features {layer.in_features} of a {layer.in_features}→{layer.out_features} "
                              f"linear layer; choose int4-g32 or another group size that divides it")
        super().create_weights(layer)

    def process_weights_after_loading(self, layer: Linear) -> None:
        q, scales, mins = quantize_int4(layer.weight.data, self.group)
        packed: PackedWeight | TorchInt4Weight
        if self.kernels is not None:
            packed = PackedWeight(pack_q4(q), scales, mins, self.group, True, self.kernels, self.buffer)
        else:
            packed = TorchInt4Weight(q, scales, mins, self.group)
        self.replace_weight(layer, packed)
