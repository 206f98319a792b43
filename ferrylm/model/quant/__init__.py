"""Quantized Linear weights: the QuantMethod seam and the one place that picks a method."""

from __future__ import annotations

import torch

from ferrylm.config import PREQUANTIZED_METHODS, ConfigError, QuantConfig
from ferrylm.model.quant.base import QuantMethod, StoredWeightMethod, UnquantizedMethod


def select_quant_method(quant: QuantConfig | None, checkpoint_kind: str, device: torch.device,
                        dtype: torch.dtype, int8_activations: bool = False,
                        prequantized: str | None = None) -> QuantMethod:
    """The method for --quantization `quant` (None: the default) on a checkpoint of `checkpoint_kind`
    ("gguf" | "hf" | ...). Raises ConfigError, naming the flag, for what cannot run here.

    `prequantized`: the checkpoint's own int4 format (awq | gptq | compressed-tensors), kept as the file's codes.
    Default: a GGUF file keeps its blocks packed where FerryLM has a packed kernel (the CPU, when the
    C++ extension builds); everything else loads unquantized, as vLLM does for safetensors.
    `int8_activations`: fp32 activations of a decode row take the int8-activation GEMV as bf16 ones
    do (llama.cpp's arithmetic; --dtype auto on a CPU without BF16); otherwise fp32 stays exact.
    """
    from ferrylm.model.quant.kernels import load_quant_kernels

    kernels = load_quant_kernels() if device.type == "cpu" else None
    if kernels is not None and int8_activations:
        kernels = kernels._replace(fp32_int8_gemv=True)
    if prequantized is not None:  # an AWQ / GPTQ checkpoint: its own int4 weights, or nothing
        if quant is not None and quant.method != prequantized:
            raise ConfigError(f"--quantization {quant.method}: this checkpoint is already quantized with "
                              f"{prequantized} (config.json quantization_config); leave the flag unset or pass "
                              f"--quantization {prequantized}")
        from ferrylm.model.quant.prequantized import PrequantizedInt4

        return PrequantizedInt4(prequantized, kernels, dtype)
    if quant is not None and quant.method in PREQUANTIZED_METHODS:
        raise ConfigError(f"--quantization {quant.method} serves a checkpoint quantized with {quant.method} "
                          "(quantization_config.quant_method); this one is not")
    if quant is None:
        quant = QuantConfig("gguf" if checkpoint_kind == "gguf" and kernels is not None else "none")
    if quant.method == "none":
        return UnquantizedMethod()
    if quant.method == "gguf":
        if checkpoint_kind != "gguf":
            raise ConfigError(f"--quantization gguf keeps a GGUF file's blocks, but this checkpoint is "
                              f"{checkpoint_kind!r}; use int8 or int4 to quantize it at load")
        from ferrylm.model.quant.gguf import GGUFPacked

        return GGUFPacked(kernels, dtype)
    if quant.method == "fp8":
        from ferrylm.model.quant.fp8 import Fp8W8A8

        return Fp8W8A8(device)
    from ferrylm.model.quant.weight_only import Int4WeightOnly, Int8WeightOnly

    if quant.method == "int8":
        return Int8WeightOnly(kernels)
    return Int4WeightOnly(quant.group_size or 32, kernels)


__all__ = ["ConfigError", "QuantMethod", "StoredWeightMethod", "UnquantizedMethod", "select_quant_method"]
