"""QuantMethod: how a Linear holds and multiplies its weight (vLLM's LinearMethod seam).

One method object serves every layer of a model; what a layer stores lives on the layer. The life of a
layer's weight: create_weights (on the meta device, before loading) → load_weight once per checkpoint
tensor (q, k and v fill row ranges of one packed projection) → process_weights_after_loading (quantize
or repack) → apply(x) at run time. dequantize() is every method's plain-torch oracle.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from ferrylm.model.arch.layers import Linear


class StoredWeight(Protocol):
    """What a StoredWeightMethod keeps in `layer.packed`: an nn.Module (quant/packed.py, quant/torch_ops.py,
    quant/fp8.py, ...) that multiplies, dequantizes and embeds with its weight [out_features, in_features]."""

    out_features: int
    in_features: int

    def matmul(self, x: torch.Tensor) -> torch.Tensor: ...

    def dequantize(self, dtype: torch.dtype = ...) -> torch.Tensor: ...

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor: ...


class QuantMethod(ABC):
    """Weight storage and matmul of Linear layers. Subclasses set `name` (the --quantization value)."""

    name: str = "none"

    def lm_head_method(self) -> "QuantMethod":
        """The method for the LM head (and so a tied embedding): this one unless a subclass says."""
        return self

    def create_weights(self, layer: Linear) -> None:
        """Register what the checkpoint loads into (default: a float `weight` [out, in])."""
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features), requires_grad=False)

    def load_weight(self, layer: Linear, tensor, rows: slice) -> None:
        """Copy one checkpoint tensor into rows `rows` of the weight. `tensor` is a float tensor or a
        GGUF tensor still in its blocks (gguf_loader.GGUFTensor), which is dequantized here."""
        if not isinstance(tensor, torch.Tensor):
            tensor = tensor.to_float()
        layer.weight.data[rows].copy_(tensor)

    def process_weights_after_loading(self, layer: Linear) -> None:  # noqa: B027 - optional hook
        """Turn the loaded weight into the form apply() reads (default: leave it)."""

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """y = x W^T + b for x [T, in]."""

    @abstractmethod
    def dequantize(self, layer: Linear) -> torch.Tensor:
        """The float32 weight [out, in] the layer multiplies with (the oracle)."""

    @abstractmethod
    def embed(self, layer: Linear, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of W in `dtype`: how a tied embedding reads this layer's weight."""


class UnquantizedMethod(QuantMethod):
    """The float weight in the model dtype and F.linear."""

    name = "none"

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)

    def dequantize(self, layer: Linear) -> torch.Tensor:
        return layer.weight.float()

    def embed(self, layer: Linear, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return F.embedding(ids, layer.weight).to(dtype)


class StoredWeightMethod(QuantMethod):
    """A method whose processed weight is one module in `layer.packed` with matmul / dequantize / embed
    (quant/packed.py, quant/torch_ops.py); subclasses only decide how to build it."""

    def replace_weight(self, layer: Linear, packed: StoredWeight) -> None:
        """Install `packed` and drop the float weight, whose memory is the point of quantizing."""
        if isinstance(getattr(layer, "weight", None), nn.Parameter):
            del layer.weight
        layer.packed = packed

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        y = layer.packed.matmul(x)
        return y if layer.bias is None else y + layer.bias

    def dequantize(self, layer: Linear) -> torch.Tensor:
        return layer.packed.dequantize(torch.float32)

    def embed(self, layer: Linear, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return layer.packed.embed(ids, dtype)
