"""Every quantized matmul path against its dequantize-then-matmul twin, on random and real weights.

Tolerances: with fp32 activations the packed kernel multiplies the exact fp32 weight values, so it
agrees with the twin (fp32 F.linear on dequantize()) to 1e-5 of the output's magnitude (summation
order only). With bf16 activations the outputs are bf16 (8 significant bits) and the AMX / GEMM paths
round the unpacked weights to bf16 as the dequantized bf16 model does: 2e-2 of the magnitude. The
int8 path for bf16 activations (up to packed.INT8_M rows, vnni_gemv.cpp) also rounds x to int8 per block of 32,
as llama.cpp does; test_vnni_path_error_is_bounded_by_activation_rounding states its own bound.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ferrylm.model.loaders.gguf_dequant import BLOCK_SIZES, INTEGER_TYPES, GGMLType, dequantize, integer_blocks
from ferrylm.model.quant import packed as packed_mod
from ferrylm.model.quant.gguf import merge_rows, repack
from ferrylm.model.quant.kernels import load_quant_kernels
from ferrylm.model.quant.layout import dequantize_packed, pack_q4, unpack_q4
from ferrylm.model.quant.packed import PackedWeight, SegmentedWeight
from ferrylm.model.quant.torch_ops import TorchInt4Weight, TorchInt8Weight
from ferrylm.model.quant.weight_only import quantize_int4, quantize_int8
from tests.conftest import requires_smollm2

KERNELS = load_quant_kernels()
requires_kernels = pytest.mark.skipif(KERNELS is None, reason="the C++ quantized-matmul kernel did not build")
# Activation rows covering each path: 1..8 int8 GEMV (bf16), 1..6 packed kernel (fp32 up to 32; every
# row-block size: 8 and the 1..7 left in one pass), 13..64 AMX (bf16) or GEMM, 65+ panel GEMM.
ROWS = [1, 2, 3, 4, 5, 6, 7, 13, 16, 64, 70]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def assert_close_to_twin(weight, x: torch.Tensor) -> None:
    """weight.matmul(x) vs F.linear on weight.dequantize(), relative to the output's magnitude."""
    got = weight.matmul(x)
    assert got.shape == (x.shape[0], weight.out_features) and got.dtype == x.dtype
    ref = F.linear(x.float(), weight.dequantize(torch.float32))
    err = (got.float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-12)
    assert err < TOL[x.dtype], f"M={x.shape[0]} {x.dtype}: relative error {err:.2e}"


def _random_packed(kind: str, n: int, k: int, gen: torch.Generator) -> PackedWeight:
    if kind == "q4_1":
        q = torch.randint(0, 16, (n, k), generator=gen)
        return PackedWeight(pack_q4(q), (torch.rand(n, k // 32, generator=gen) * 0.01).half(),
                            (torch.randn(n, k // 32, generator=gen) * 0.01).half(), 32, True, KERNELS)
    if kind == "q4_g64_fp32":
        q = torch.randint(0, 16, (n, k), generator=gen)
        return PackedWeight(pack_q4(q), torch.rand(n, k // 64, generator=gen) * 0.01,
                            torch.randn(n, k // 64, generator=gen) * 0.01, 64, True, KERNELS)
    group = {"q8_0": 32, "q8_g16": 16, "q8_channel": k}[kind]
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen).view(torch.uint8)
    scales = torch.rand(n, k // group, generator=gen) * 0.001
    return PackedWeight(codes, scales.half() if kind == "q8_0" else scales, None, group, False, KERNELS)


@requires_kernels
@pytest.mark.parametrize("kind", ["q4_1", "q4_g64_fp32", "q8_0", "q8_g16", "q8_channel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_matmul_matches_twin_random(kind, dtype):
    gen = torch.Generator().manual_seed(0)
    w = _random_packed(kind, 100, 192, gen)
    for m in ROWS:
        assert_close_to_twin(w, torch.randn(m, 192, generator=gen).to(dtype))


@requires_kernels
def test_large_batch_panels_and_unpack_are_exact(monkeypatch):
    """The panel GEMM path with several panels, and the C++ unpack vs the torch twin bit for bit."""
    gen = torch.Generator().manual_seed(1)
    w = _random_packed("q4_1", 300, 128, gen)
    monkeypatch.setattr(packed_mod, "PANEL_ROWS", 128)
    assert_close_to_twin(w, torch.randn(80, 128, generator=gen))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = KERNELS.dequantize(w.codes, w.scales, w.mins, w.group, w.q4, dtype)
        assert torch.equal(got, w.dequantize(torch.float32).to(dtype))


@requires_kernels
def test_weight_only_int8_int4_quantizers():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(64, 256, generator=gen) * 0.05
    codes, scales = quantize_int8(w)
    assert codes.dtype == torch.int8 and codes.abs().max() <= 127
    assert ((codes.float() * scales - w).abs() <= scales / 2 + 1e-7).all()
    for group in (32, 64, 128):
        q, s, m = quantize_int4(w, group)
        assert q.max() <= 15 and s.dtype == m.dtype == torch.float16
        deq = dequantize_packed(pack_q4(q), s, m, group, True)
        step = s.float().repeat_interleave(group, 1)
        assert ((deq - w).abs() <= step * 0.5 + 1e-3 * step + 1e-6).all()
        packed = PackedWeight(pack_q4(q), s, m, group, True, KERNELS)
        for m_rows in (1, 8):
            assert_close_to_twin(packed, torch.randn(m_rows, 256, generator=gen))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_fallbacks_match_twin(dtype):
    """torch._weight_int8pack_mm and _weight_int4pack_mm_for_cpu (the no-extension path); the latter
    dequantizes as (q - 8) * scale + zero, which TorchInt4Weight's zero = min + 8 * scale relies on."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(96, 128, generator=gen) * 0.05
    codes, scales = quantize_int8(w)
    q, s, m = quantize_int4(w, 32)
    for weight in (TorchInt8Weight(codes, scales), TorchInt4Weight(q, s, m, 32)):
        for rows in (1, 5, 33):
            assert_close_to_twin(weight, torch.randn(rows, 128, generator=gen).to(dtype))


def test_torch_int4pack_zero_point_convention():
    gen = torch.Generator().manual_seed(4)
    q = torch.randint(0, 16, (32, 64), dtype=torch.int32, generator=gen)
    scale, zero = torch.rand(2, 32, generator=gen) + 0.1, torch.randn(2, 32, generator=gen)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    y = torch._weight_int4pack_mm_for_cpu(torch.eye(64), packed, 32, torch.stack((scale, zero), -1))
    expected = (q - 8) * scale.t().repeat_interleave(32, 1) + zero.t().repeat_interleave(32, 1)
    assert torch.allclose(y.t(), expected, atol=1e-5)


def _random_blocks(kind: GGMLType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random ggml blocks with sane fp16 scales (random bytes would hold infs and NaNs there)."""
    block, size = BLOCK_SIZES[kind]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    half = lambda v: np.frombuffer(np.float16(v).tobytes(), np.uint8)  # noqa: E731
    if kind == GGMLType.Q6_K:
        raw[..., 208:210] = half(0.003)
    else:
        raw[..., 0:2] = half(0.01)
        if kind in (GGMLType.Q4_1, GGMLType.Q4_K, GGMLType.Q5_K):
            raw[..., 2:4] = half(0.004 if kind != GGMLType.Q4_1 else -0.05)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", sorted(INTEGER_TYPES), ids=lambda t: t.name)
def test_gguf_repack_is_lossless(kind):
    """Each GGUF block format repacked: dequantize() equals the gguf package's own dequantization,
    the codes unpack to the integers the blocks hold, and the matmul agrees with its twin."""
    gguf = pytest.importorskip("gguf")
    from ferrylm.model.loaders.gguf_loader import GGUFTensor

    rng = np.random.default_rng(int(kind))
    raw = _random_blocks(kind, 64, 512, rng)
    tensor = GGUFTensor(int(kind), torch.from_numpy(raw.copy()), (64, 512))
    weight = repack(tensor, KERNELS)
    reference = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(kind))).astype(np.float32))
    assert torch.allclose(weight.dequantize(), reference, rtol=1e-6, atol=1e-7)
    assert torch.equal(weight.dequantize(), dequantize(raw, int(kind), (64, 512)))
    ints = integer_blocks(raw, int(kind), (64, 512))
    codes = unpack_q4(weight.codes).to(torch.int16) if weight.q4 else weight.codes.view(torch.int8).to(torch.int16)
    assert torch.equal(codes, ints.codes)
    if KERNELS is not None:
        for rows in (1, 9, 65):
            assert_close_to_twin(weight, torch.randn(rows, 512).to(torch.bfloat16))


def test_mixed_formats_in_one_projection_are_segmented():
    """q, k, v of one packed projection in different GGUF formats: runs of one layout, concatenated."""
    from ferrylm.model.loaders.gguf_loader import GGUFTensor

    rng = np.random.default_rng(5)
    parts = [repack(GGUFTensor(int(k), torch.from_numpy(_random_blocks(k, r, 256, rng)), (r, 256)), KERNELS)
             for k, r in ((GGMLType.Q4_K, 64), (GGMLType.Q4_K, 32), (GGMLType.Q6_K, 32))]
    merged = merge_rows(parts, KERNELS)
    assert isinstance(merged, SegmentedWeight) and len(merged.parts) == 2 and merged.out_features == 128
    assert torch.equal(merged.dequantize(), torch.cat([p.dequantize() for p in parts]))
    for rows in (1, 20):
        assert_close_to_twin(merged, torch.randn(rows, 256))


@requires_smollm2
def test_default_model_tensors_repack_losslessly():
    """Every tensor type the default model file holds (Q4_1 linears, Q8_0 tied embedding / lm_head;
    F32 norms stay float): repacked codes are the file's integers, scales / mins its fp16 values, and the
    matmuls agree with their twins on these real weights."""
    from ferrylm.model.loaders.gguf_dequant import GGMLType
    from ferrylm.model.loaders.gguf_loader import GGUFFile, _raw_tensor
    from ferrylm.model.loaders.model_source import resolve_model

    path = resolve_model("smollm2-135m").path
    gguf = GGUFFile(path)
    kinds = {GGMLType(t.tensor_type).name for t in gguf.tensors}
    assert kinds == {"F32", "Q4_1", "Q8_0"}, kinds
    by_name = {t.name: t for t in gguf.tensors}
    for name in ("blk.0.attn_q.weight", "blk.7.ffn_down.weight", "token_embd.weight"):
        t = by_name[name]
        raw = np.asarray(gguf.data(t)).reshape(t.shape[1], -1)  # [rows, bytes per row]
        tensor = _raw_tensor(gguf, t)
        weight = repack(tensor, KERNELS)
        if GGMLType(t.tensor_type).name == "Q4_1":
            blocks = raw.reshape(raw.shape[0], -1, 20)
            nibbles = blocks[..., 4:]
            file_codes = np.concatenate((nibbles & 0x0F, nibbles >> 4), axis=-1).reshape(raw.shape[0], -1)
            assert np.array_equal(unpack_q4(weight.codes).numpy(), file_codes)
            assert np.array_equal(weight.scales.numpy().view(np.uint8), blocks[..., 0:2].reshape(raw.shape[0], -1))
            assert np.array_equal(weight.mins.numpy().view(np.uint8), blocks[..., 2:4].reshape(raw.shape[0], -1))
        else:
            blocks = raw.reshape(raw.shape[0], -1, 34)
            assert np.array_equal(weight.codes.numpy(), blocks[..., 2:].reshape(raw.shape[0], -1))
            assert np.array_equal(weight.scales.numpy().view(np.uint8), blocks[..., 0:2].reshape(raw.shape[0], -1))
        assert torch.equal(weight.dequantize(), tensor.to_float())
        if KERNELS is not None:
            gen = torch.Generator().manual_seed(6)
            for rows in (1, 4, 16, 70):
                for dtype in (torch.float32, torch.bfloat16):
                    assert_close_to_twin(weight, torch.randn(rows, weight.in_features, generator=gen).to(dtype))
        ids = torch.tensor([0, 5, 123, weight.out_features - 1])
        assert torch.equal(weight.embed(ids, torch.float32), weight.dequantize()[ids])


@requires_kernels
@pytest.mark.skipif(KERNELS is None or not KERNELS.has_vnni, reason="built without AVX512-VNNI")
@pytest.mark.parametrize("kind", ["q4_1", "q4_g64_fp32", "q8_0", "q8_channel"])
def test_vnni_path_error_is_bounded_by_activation_rounding(kind):
    """quant_linear_vnni vs the twin: x is rounded to int8 per block of 32 (|error| <= amax_block / 254
    per element), so |y - twin| <= sum over k of |w_k| * amax(block of k) / 254, plus bf16 output
    rounding (2^-8 of |y|). Checked per output element, for 1..8 rows and odd block counts (K = 96),
    and the fp32 result equals the dequantized weight times the rounded x (mins included)."""
    gen = torch.Generator().manual_seed(7)
    for k in ((192, 96) if kind != "q4_g64_fp32" else (192, 128)):
        w = _random_packed(kind, 50, k, gen)
        if w.group % 64 and w.group != 32:
            continue
        dense = w.dequantize(torch.float32)
        for m in (1, 2, 3, 4, 5, 6, 7, 8, 11, 16):
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            got = KERNELS.quant_linear_vnni(x, w.codes, w.scales, w.mins, w.group, w.q4)
            assert got.dtype == torch.bfloat16 and got.shape == (m, 50)
            ref = F.linear(x.float(), dense)
            amax = x.float().reshape(m, -1, 32).abs().amax(-1).repeat_interleave(32, 1)  # [m, k]
            bound = (amax / 254) @ dense.abs().t() + ref.abs() * 2 ** -8 + 1e-6
            assert ((got.float() - ref).abs() <= bound * 1.01).all(), kind
            xf = x.float().reshape(m, -1, 32)  # rounded as the kernel does: x * (127 / amax), to nearest even
            amax_b = xf.abs().amax(-1, keepdim=True)
            # torch.full_like / t, not 127 / t: torch computes the latter as a reciprocal times 127
            inv = torch.where(amax_b > 0, torch.full_like(amax_b, 127) / amax_b.clamp(min=1e-30), 0.0)
            rounded = (torch.round(xf * inv) * (amax_b / 127)).reshape(m, k)
            exact = F.linear(rounded, dense)
            got32 = KERNELS.quant_linear_vnni(x.float(), w.codes, w.scales, w.mins, w.group, w.q4)
            assert (got32 - exact).abs().max() <= 1e-5 * exact.abs().max(), kind
            assert_close_to_twin(w, x)  # and PackedWeight.matmul takes it within the general tolerance
    if kind == "q8_channel":  # K = 96 per channel: a group that is neither 32 nor a multiple of 64
        w = _random_packed(kind, 50, 96, gen)
        assert w.int8_rows(x.dtype) == 0
        with pytest.raises(RuntimeError, match="group 96 unsupported"):
            KERNELS.quant_linear_vnni(x[:, :96].contiguous(), w.codes, w.scales, w.mins, w.group, w.q4)


@requires_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_matmul_of_no_rows_is_empty(dtype):
    """A step that samples no row (max_tokens=0, a mid-prefill chunk) runs the LM head on 0 rows: every
    kernel path answers [0, out] (the VNNI one read row 0 of an empty batch and crashed the process)."""
    w = _random_packed("q4_1", 50, 192, torch.Generator().manual_seed(8))
    assert w.matmul(torch.empty(0, 192, dtype=dtype)).shape == (0, 50)
    if KERNELS.has_vnni:
        assert KERNELS.quant_linear_vnni(torch.empty(0, 192, dtype=dtype), w.codes, w.scales, w.mins, w.group,
                                         w.q4).shape == (0, 50)
