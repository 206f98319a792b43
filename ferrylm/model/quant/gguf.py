"""GGUF weights kept in their quantized form: ggml blocks repacked at load into the kernel's layout.

Lossless for every format handled: the integer codes are the file's, the scales and mins the file's
fp16 values (Q4_0, Q4_1, Q8_0) or exact fp32 products of them (K-quants):
  Q4_0 → q4, scale d, min -8d          Q4_1 → q4, scale d, min m (bytes copied as they are)
  Q8_0 → q8, group 32, scale d          Q4_K → q4, per 32: scale d*sc, min -dmin*m
  Q5_K → q8 (codes 0..31), per 32       Q6_K → q8 (codes -32..31), per 16: scale d*sc
The K-quants cost more bytes here than in the file (Q4_K 0.75 vs 0.56, Q6_K 1.25 vs 0.82 bytes per
weight); F32 / F16 / BF16 tensors stay float.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from ferrylm.model.loaders.gguf_dequant import INTEGER_TYPES, GGMLType, integer_blocks
from ferrylm.model.quant.base import StoredWeightMethod
from ferrylm.model.quant.layout import pack_q4
from ferrylm.model.quant.packed import FloatWeight, PackedWeight, SegmentedWeight, UnpackBuffer

if TYPE_CHECKING:
    from ferrylm.model.arch.layers import Linear

_Q4_TYPES = frozenset({GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q4_K})


def repack(tensor, kernels=None, float_dtype: torch.dtype = torch.float32,
           buffer: UnpackBuffer | None = None) -> PackedWeight | FloatWeight:
    """A GGUFTensor (or a float tensor) → PackedWeight, or FloatWeight (in `float_dtype`) for floats."""
    if isinstance(tensor, torch.Tensor):
        return FloatWeight(tensor.to(float_dtype))
    kind = GGMLType(tensor.ggml_type)
    if kind not in INTEGER_TYPES:
        return FloatWeight(tensor.to_float().to(float_dtype))
    blocks = integer_blocks(tensor.data, kind, tensor.shape)
    if kind == GGMLType.Q4_1:  # the file's nibbles are already the kernel's: copy the bytes
        codes = tensor.data.reshape(tensor.shape[0], -1, 20)[..., 4:].reshape(tensor.shape[0], -1)
    elif kind in _Q4_TYPES:
        codes = pack_q4(blocks.codes)
    else:
        codes = blocks.codes.to(torch.int8).view(torch.uint8)
    return PackedWeight(codes.clone(), blocks.scale.clone(), None if blocks.min is None else blocks.min.clone(),
                        blocks.group, kind in _Q4_TYPES, kernels, buffer)


def _layout_key(w: PackedWeight | FloatWeight) -> tuple:
    if not isinstance(w, PackedWeight):
        return ("float", w.weight.dtype)
    return ("packed", w.q4, w.group, w.scales.dtype, w.mins is None)


def merge_rows(parts: list[PackedWeight | FloatWeight], kernels=None,
               buffer: UnpackBuffer | None = None) -> PackedWeight | FloatWeight | SegmentedWeight:
    """Stack row ranges into one weight: one PackedWeight (or FloatWeight) when they share a layout,
    else a SegmentedWeight of runs that do."""
    runs: list[list[PackedWeight | FloatWeight]] = []
    for p in parts:
        if runs and _layout_key(runs[-1][-1]) == _layout_key(p):
            runs[-1].append(p)
        else:
            runs.append([p])
    merged = [_stack(run, kernels, buffer) for run in runs]
    return merged[0] if len(merged) == 1 else SegmentedWeight(merged)


def _stack(run: list[PackedWeight | FloatWeight], kernels, buffer: UnpackBuffer | None) -> PackedWeight | FloatWeight:
    """`run`: weights of one layout (_layout_key), so all FloatWeight or all PackedWeight with mins or without."""
    if len(run) == 1:
        return run[0]
    if isinstance(run[0], FloatWeight):
        return FloatWeight(torch.cat([p.weight for p in cast("list[FloatWeight]", run)]))
    packed = cast("list[PackedWeight]", run)
    first = packed[0]
    mins = None if first.mins is None else torch.cat([cast(torch.Tensor, p.mins) for p in packed])
    return PackedWeight(torch.cat([p.codes for p in packed]), torch.cat([p.scales for p in packed]), mins,
                        first.group, first.q4, kernels, buffer)


class GGUFPacked(StoredWeightMethod):
    """--quantization gguf: each Linear keeps the file's blocks (repacked, never dequantized)."""

    name = "gguf"

    def __init__(self, kernels=None, float_dtype: torch.dtype = torch.float32):
        self.kernels, self.float_dtype, self.buffer = kernels, float_dtype, UnpackBuffer()

    def create_weights(self, layer: Linear) -> None:
        layer.gguf_shards = []  # (first row, tensor) until process_weights_after_loading

    def load_weight(self, layer: Linear, tensor, rows: slice) -> None:
        layer.gguf_shards.append((rows.start or 0, tensor))

    def process_weights_after_loading(self, layer: Linear) -> None:
        shards = sorted(layer.gguf_shards, key=lambda s: s[0])
        del layer.gguf_shards
        parts = [repack(t, self.kernels, self.float_dtype, self.buffer) for _, t in shards]
        self.replace_weight(layer, merge_rows(parts, self.kernels, self.buffer))
