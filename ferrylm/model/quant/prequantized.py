"""--quantization awq | gptq: a pre-quantized int4 checkpoint kept as the file's codes.

Each Linear's Int4Tensor (loaders/int4_checkpoint.py) becomes a PackedWeight in the q4 layout with
the file's codes, scale s and min -s*z per group: the packed kernel computes exactly what the
checkpoint means. An act-order (GPTQ desc_act) weight permutes its inputs so groups are contiguous;
the activations are gathered in that order before the matmul. Float tensors in such a checkpoint
(the LM head, modules left unquantized) stay float.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from ferrylm.model.quant.base import StoredWeight, StoredWeightMethod, UnquantizedMethod
from ferrylm.model.quant.gguf import merge_rows
from ferrylm.model.quant.layout import pack_q4
from ferrylm.model.quant.packed import FloatWeight, PackedWeight, SegmentedWeight, UnpackBuffer

if TYPE_CHECKING:
    from ferrylm.model.arch.layers import Linear


class PermutedInputs(nn.Module):
    """A weight whose input columns are stored in `perm` order: x is gathered the same way."""

    perm: torch.Tensor
    inverse: torch.Tensor

    def __init__(self, inner: StoredWeight, perm: torch.Tensor):
        super().__init__()
        self.inner = inner
        self.register_buffer("perm", perm)
        self.register_buffer("inverse", torch.argsort(perm))
        self.out_features, self.in_features = inner.out_features, inner.in_features

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.matmul(x.index_select(-1, self.perm))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.inner.dequantize(dtype).index_select(1, self.inverse)

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.dequantize(dtype)[ids]


class PrequantizedInt4(StoredWeightMethod):
    """Keeps an AWQ / GPTQ checkpoint's int4 weights as they are (see the module docstring)."""

    def __init__(self, method: str, kernels=None, float_dtype: torch.dtype = torch.float32):
        self.name = method
        self.kernels, self.float_dtype, self.buffer = kernels, float_dtype, UnpackBuffer()

    def lm_head_method(self) -> UnquantizedMethod:
        return UnquantizedMethod()  # AWQ and GPTQ leave the LM head in float

    def create_weights(self, layer: Linear) -> None:
        layer.int4_shards = []  # (first row, tensor) until process_weights_after_loading

    def load_weight(self, layer: Linear, tensor, rows: slice) -> None:
        layer.int4_shards.append((rows.start or 0, tensor))

    def process_weights_after_loading(self, layer: Linear) -> None:
        shards = [t for _, t in sorted(layer.int4_shards, key=lambda s: s[0])]
        del layer.int4_shards
        perms = [getattr(t, "perm", None) for t in shards]
        weight: StoredWeight
        if all(p is None for p in perms):
            weight = merge_rows([self._module(t) for t in shards], self.kernels, self.buffer)
        elif all(p is not None and torch.equal(p, cast(torch.Tensor, perms[0])) for p in perms):
            # q/k/v share their input's act order (perms[0] is a tensor here, as every perm is)
            weight = PermutedInputs(merge_rows([self._module(t) for t in shards], self.kernels, self.buffer),
                                    cast(torch.Tensor, perms[0]))
        else:
            parts = [self._module(t) if p is None else PermutedInputs(self._module(t), p)
                     for t, p in zip(shards, perms)]
            weight = parts[0] if len(parts) == 1 else SegmentedWeight(parts)
        self.replace_weight(layer, weight)

    def _module(self, tensor) -> FloatWeight | PackedWeight:
        if isinstance(tensor, torch.Tensor):
            return FloatWeight(tensor.to(self.float_dtype))
        return PackedWeight(pack_q4(tensor.codes), tensor.scales, tensor.mins, tensor.group, True, self.kernels,
                            self.buffer)
