"""Quantized KV cache (--kv-cache-dtype fp8 / int8): layout, allocation, and the plain-torch
quantize-on-write / dequantize-on-read that every kernel is tested against.

A cache is still one tensor [num_blocks, block_size, num_kv_heads, head_dim] per K and per V (the
KVCache tuple every layer, the compiled step and the CUDA graphs already pass around), stored in
1-byte codes. Its scales live in the same allocation, right after the codes, so they travel with
the tensor through every existing signature without a second argument:

- fp8 (e4m3, vLLM's default, or e5m2): one float32 per-tensor scale, stored value = x / scale,
  saturated to the format's max (±448 for e4m3). The scale is 1.0, as in vLLM when a checkpoint
  carries no k_scale/v_scale: SmolLM2's K reaches |21| and V |18| on tests/data/english.txt, far
  inside ±448, and e4m3 is floating point, so a larger scale buys nothing but clipping risk.
- int8: one float16 scale per (token, KV head) row of head_dim codes, amax / 127, computed when the
  row is written. Per-tensor int8 would put K's outlier channels (|K| up to ~20, median ~1) and
  the rest on one grid; a row scale adapts to each token. float16 (2 bytes per 64 codes) keeps the
  pool at 1.94x tokens of bf16 where a float32 scale would give 1.88x.

Only torch ops that keep the storage (views, in-place writes) may touch a quantized cache: a clone
drops the scales. The C++ kernels (csrc/paged_decode.cpp) read the same layout and check the size.
"""

from __future__ import annotations

import torch

FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)
FP8_SCALE = 1.0  # per-tensor scale of an fp8 cache (see the module docstring)
INT8_MAX = 127.0
MIN_DIVISOR = 1e-30  # int8 rows divide by max(scale, this); the C++ writer does the same
SCALE_DTYPE = {torch.int8: torch.float16, torch.float8_e4m3fn: torch.float32, torch.float8_e5m2: torch.float32}


def storage_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element dtype of a cache for a --kv-cache-dtype value ("auto": the model's dtype)."""
    if cache_dtype == "auto":
        return model_dtype
    if cache_dtype == "int8":
        return torch.int8
    return FP8_DTYPES[cache_dtype]


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in QUANTIZED_DTYPES


def _num_scales(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    if dtype == torch.int8:
        return shape[0] * shape[1] * shape[2]  # one per (block, offset, KV head) row
    return 1 if dtype in QUANTIZED_DTYPES else 0


def _scale_offset(numel: int) -> int:
    """Byte offset of the scales: after the codes, rounded up so a float32 scale is aligned."""
    return -(-numel // 4) * 4


def scale_bytes_per_block(block_size: int, num_kv_heads: int, dtype: torch.dtype) -> int:
    """Scale bytes one block adds to one cache tensor (int8 row scales; fp8's one scale is per tensor)."""
    return block_size * num_kv_heads * SCALE_DTYPE[dtype].itemsize if dtype == torch.int8 else 0


def allocate(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zeroed cache of `shape`; a quantized one carries its scales after the codes (fp8: FP8_SCALE)."""
    if dtype not in QUANTIZED_DTYPES:
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = shape[0] * shape[1] * shape[2] * shape[3]
    scale_dtype = SCALE_DTYPE[dtype]
    buf = torch.zeros(_scale_offset(numel) + _num_scales(shape, dtype) * scale_dtype.itemsize, dtype=torch.uint8,
                      device=device)
    cache = buf[:numel].view(dtype).view(shape)
    if dtype != torch.int8:
        scales(cache).fill_(FP8_SCALE)
    return cache


def scales(cache: torch.Tensor) -> torch.Tensor:
    """The scales stored after a quantized cache's codes: [num_blocks, block_size, Hkv] float16 for
    int8, [1] float32 for fp8. A view: writing it writes the cache's scales."""
    if cache.storage_offset() != 0 or not cache.is_contiguous():
        raise ValueError("a quantized KV cache must be the contiguous tensor kv_quant.allocate() returned")
    dtype = SCALE_DTYPE[cache.dtype]
    count = _num_scales(tuple(cache.shape), cache.dtype)
    offset = _scale_offset(cache.numel())
    if cache.untyped_storage().nbytes() < offset + count * dtype.itemsize:
        raise ValueError("this quantized KV cache has no scales after its codes: allocate it with kv_quant.allocate()")
    out = torch.empty(0, dtype=dtype, device=cache.device)
    out.set_(cache.untyped_storage(), offset // dtype.itemsize, (count,), (1,))
    return out.view(cache.shape[:3]) if cache.dtype == torch.int8 else out


def quantize(x: torch.Tensor, dtype: torch.dtype,
             fp8_scale: float = FP8_SCALE) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Codes of rows x [..., Hkv, D] and, for int8, their float16 row scales [..., Hkv]."""
    xf = x.float()
    if dtype == torch.int8:
        scale = (xf.abs().amax(dim=-1) / INT8_MAX).to(torch.float16)
        s = scale.float().clamp_min(MIN_DIVISOR)[..., None]  # an all-zero row: codes 0 / 1e-30
        return (xf / s).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale
    limit = torch.finfo(dtype).max
    return (xf / fp8_scale).clamp(-limit, limit).to(dtype), None


def dequantize(codes: torch.Tensor, row_scales: torch.Tensor | None, fp8_scale: torch.Tensor | float,
               out_dtype: torch.dtype) -> torch.Tensor:
    """Rows [..., Hkv, D] back in `out_dtype`: int8 codes times their row scales, fp8 times the tensor's."""
    if codes.dtype == torch.int8:
        assert row_scales is not None
        return (codes.float() * row_scales.float()[..., None]).to(out_dtype)
    return (codes.float() * fp8_scale).to(out_dtype)


def write(x: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize rows x [T, Hkv, D] into slots of `cache` (index_copy_ has no fp8 kernel: byte views)."""
    num_kv_heads, head_dim = cache.shape[-2:]
    stored = scales(cache)
    codes, row_scales = quantize(x, cache.dtype, float(stored[0]) if cache.dtype != torch.int8 else FP8_SCALE)
    flat = cache.view(torch.uint8).view(-1, num_kv_heads, head_dim)
    flat.index_copy_(0, slot_mapping, codes.view(torch.uint8))
    if row_scales is not None:
        stored.view(-1, num_kv_heads).index_copy_(0, slot_mapping, row_scales)


def read_blocks(cache: torch.Tensor, blocks: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Blocks `blocks` (any int64 shape) of a quantized cache, dequantized: [*blocks.shape, bs, Hkv, D]."""
    codes = cache.view(torch.uint8)[blocks].view(cache.dtype)
    stored = scales(cache)
    if cache.dtype == torch.int8:
        return dequantize(codes, stored[blocks], 1.0, out_dtype)
    return dequantize(codes, None, stored[0], out_dtype)
