"""Every instruction-set variant of the quantized-matmul kernels against the plain-torch twin.

Each variant this CPU runs among portable (no SIMD: the scalar twin), avx2 (AVX2 + FMA + F16C, the
8-wide paths) and avx512_bf16 (AVX-512 + VNNI + BF16) is built and compared on every packed layout: q4
with and without mins, q8 with groups of 16 (Q6_K), 32, 64, 128, 256 and per channel, fp16 and fp32
scales, odd block counts, output counts off the kernels' tile sizes, 0..40 activation rows.

Tolerances (as in test_quant_kernels.py): the exact path multiplies the exact fp32 weights, so it meets
the twin up to fp32 summation order; the int8-activation path (quant_linear_vnni) equals the
dequantized weight times x rounded to int8 per 32-element block, within fp32 summation order, and
the AVX2 and AVX512-VNNI versions of it agree with each other as closely.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ferrylm.model.cpu.cpu_isa import BY_NAME, this_cpu
from ferrylm.model.quant.kernels import load_quant_kernels
from ferrylm.model.quant.layout import dequantize_packed, expand_groups, pack_q4, unpack_q4

VARIANTS = ("portable", "avx2", "avx512_bf16")
ROWS = (0, 1, 2, 3, 4, 5, 8, 17, 40)
INT8_ROWS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 17, 40)  # 8 per tile: one chunk, several, a partial last one
# (q4, group, in_features, mins, fp16 scales): every group size with an odd block count where the group
# allows one (K = 96: 3 blocks), K a multiple of each group, and a per-channel group of 576 (= 9 * 64).
FORMATS = [
    (True, 32, 96, True, True),      # Q4_1, 3 blocks
    (True, 32, 768, False, True),    # Q4_0
    (True, 64, 192, True, False),
    (True, 128, 768, True, True),    # int4-g128
    (True, 256, 768, False, False),
    (False, 16, 96, False, False),   # Q6_K, 3 blocks
    (False, 16, 256, True, True),
    (False, 32, 96, False, True),    # Q8_0, 3 blocks
    (False, 64, 192, True, False),
    (False, 128, 768, False, True),
    (False, 256, 768, True, False),
    (False, 576, 576, False, False),  # int8 per channel
    (False, 96, 96, False, False),    # per channel, a group the int8 path does not take
]
FORMAT_IDS = [f"{'q4' if q4 else 'q8'}-g{g}-k{k}{'-mins' if m else ''}-{'f16' if h else 'f32'}"
              for q4, g, k, m, h in FORMATS]


class Weight:
    """A packed weight and its dequantized fp32 twin."""

    def __init__(self, q4: bool, group: int, n: int, k: int, mins: bool, f16: bool, seed: int):
        gen = torch.Generator().manual_seed(seed)
        if q4:
            self.codes = pack_q4(torch.randint(0, 16, (n, k), generator=gen))
        else:
            self.codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen).view(torch.uint8)
        dtype = torch.float16 if f16 else torch.float32
        self.scales = (torch.rand(n, k // group, generator=gen) * 0.01 + 1e-4).to(dtype)
        # Q4_1-like mins (~ -8 scales) make scale * q and min nearly cancel: the hard case for rounding
        offset = torch.randn(n, k // group, generator=gen) * 1e-3
        self.mins = (-8 * self.scales.float() + offset).to(dtype) if mins else None
        self.q4, self.group, self.n, self.k = q4, group, n, k
        self.dense = dequantize_packed(self.codes, self.scales, self.mins, group, q4)
        q = unpack_q4(self.codes).float() if q4 else self.codes.view(torch.int8).float()
        self.magnitude = q.abs() * expand_groups(self.scales.abs(), group)  # |q * s| + |min|
        if mins:
            self.magnitude += expand_groups(self.mins.abs(), group)

    def args(self) -> tuple:
        return self.codes, self.scales, self.mins, self.group, self.q4


def _missing(name: str) -> list[str]:
    return sorted(BY_NAME[name].requires - this_cpu().flags)


@pytest.fixture(scope="module", params=VARIANTS)
def kernels(request):
    name = request.param
    if not this_cpu().supports(BY_NAME[name]):
        pytest.skip(f"this CPU lacks {', '.join(_missing(name)) or 'the architecture'} for {name}")
    k = load_quant_kernels(name)
    if k is None:
        if load_quant_kernels("portable") is None:
            pytest.skip("no C++ toolchain: the kernels do not build here at all")
        pytest.fail(f"the {name} kernels did not build (the portable ones did)")
    assert k.variant == name
    return k


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the int8 path does: per 32-element block, x * (127 / amax) to nearest even, times
    amax / 127 (torch.full_like / t, not 127 / t: torch computes the latter as a reciprocal times 127)."""
    m, k = x.shape
    xb = x.float().reshape(m, k // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax.clamp(min=1e-30), 0.0)
    return (torch.round(xb * inv) * (amax / 127)).reshape(m, k)


def assert_fp32_close(got: torch.Tensor, ref: torch.Tensor, what: str, rel: float = 1e-5) -> None:
    """Within fp32 summation order: rel of the output's magnitude (the existing tests' tolerance)."""
    assert got.shape == ref.shape, what
    scale = max(ref.abs().max().item(), 1e-12) if ref.numel() else 1.0
    err = (got.float() - ref).abs().max().item() / scale if ref.numel() else 0.0
    assert err <= rel, f"{what}: relative error {err:.2e}"


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_exact_path_matches_twin(kernels, fmt):
    """quant_linear with fp32 activations multiplies the exact fp32 weights: the twin up to summation order.
    37 outputs: tiles of 16 with 4-, 2- and 1-row remainders."""
    q4, group, k, mins, f16 = fmt
    w = Weight(q4, group, 37, k, mins, f16, seed=group + k)
    gen = torch.Generator().manual_seed(1)
    for m in ROWS:
        x = torch.randn(m, k, generator=gen)
        got = kernels.quant_linear(x, *w.args())
        assert got.dtype == torch.float32
        assert_fp32_close(got, F.linear(x, w.dense), f"{kernels.variant} M={m}")
    x = torch.randn(3, k, generator=gen).bfloat16()  # other activation dtypes: same path, output rounded
    got = kernels.quant_linear(x, *w.args())
    assert got.dtype == torch.bfloat16
    assert_fp32_close(got, F.linear(x.float(), w.dense), f"{kernels.variant} bf16", rel=2 ** -7)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_int8_path_equals_twin_on_rounded_activations(kernels, fmt):
    """quant_linear_vnni: exactly the dequantized weight times the int8-rounded x (up to fp32 order),
    hence within sum |w| * amax / 254 of the twin on x itself."""
    q4, group, k, mins, f16 = fmt
    assert kernels.has_vnni == (kernels.variant != "portable")
    w = Weight(q4, group, 37, k, mins, f16, seed=group + k)
    x = torch.randn(max(INT8_ROWS), k, generator=torch.Generator().manual_seed(2))
    if not kernels.has_vnni:
        with pytest.raises(RuntimeError, match="built without int8 dot products"):
            kernels.quant_linear_vnni(x, *w.args())
        return
    if group not in (16, 32) and group % 64:
        with pytest.raises(RuntimeError, match=f"group {group} unsupported"):
            kernels.quant_linear_vnni(x, *w.args())
        return
    for m in INT8_ROWS:
        xm = x[:m].contiguous()
        got = kernels.quant_linear_vnni(xm, *w.args())
        assert got.shape == (m, 37) and got.dtype == torch.float32
        exact = F.linear(int8_rounded(xm), w.dense)
        assert_fp32_close(got, exact, f"{kernels.variant} M={m} vs rounded x")
        amax = xm.reshape(m, k // 32, 32).abs().amax(-1).repeat_interleave(32, 1)
        bound = (amax / 254) @ w.dense.abs().t() + 1e-5 * exact.abs().amax(dim=1, keepdim=True)
        assert ((got - F.linear(xm, w.dense)).abs() <= bound).all(), f"{kernels.variant} M={m} bound"
    got = kernels.quant_linear_vnni(x.bfloat16(), *w.args())
    assert got.dtype == torch.bfloat16
    assert_fp32_close(got, F.linear(int8_rounded(x.bfloat16().float()), w.dense), "bf16 x", rel=2 ** -7)
    # a row's result does not depend on which chunk of 8 it falls in
    assert torch.equal(kernels.quant_linear_vnni(x[9:17].contiguous(), *w.args()),
                       kernels.quant_linear_vnni(x, *w.args())[9:17])


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_dequantize_matches_twin(kernels, fmt):
    """dequantize / dequantize_into give the twin's values; bit for bit where the twin's q * s is exact
    (fp16 scales) or there is no min to add (the kernels round scale * q + min once, with an FMA)."""
    q4, group, k, mins, f16 = fmt
    w = Weight(q4, group, 21, k, mins, f16, seed=group + k + 1)
    exact = f16 or not mins
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = kernels.dequantize(*w.args(), dtype)
        ref = w.dense.to(dtype)
        assert got.dtype == dtype and got.shape == (21, k)
        if exact:
            assert torch.equal(got, ref), f"{kernels.variant} {dtype}"
        else:  # one rounding of q * s apart (its ulp, not the result's: min cancels most of it), then
            # possibly one step of the output dtype
            step = {torch.float32: 0.0, torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}[dtype]
            bound = 2 ** -23 * w.magnitude + step * ref.float().abs()
            assert ((got.float() - ref.float()).abs() <= bound).all(), f"{kernels.variant} {dtype}"
    out = torch.empty(21, k, dtype=torch.bfloat16)
    kernels.dequantize_into(*w.args(), out)
    assert torch.equal(out, kernels.dequantize(*w.args(), torch.bfloat16))


def test_bf16_and_fp16_stores_round_like_torch(kernels):
    """Ties, values just off a tie, overflow to inf and subnormals: the unpacked bf16 / fp16 equal
    torch's own conversion of the fp32 weights (round to nearest even)."""
    ulp8 = 2.0 ** -8
    values = [1 + ulp8, 1 + 3 * ulp8, 1 + ulp8 * 1.0001, 1 - ulp8 / 2, -(1 + ulp8), 3.4e38, -3.4e38, 65519.0,
              65520.0, 1e-40, -1e-45, 2.0 ** -25, 0.0, -0.0, 1e-8, 1234.5678]
    # q8 codes of 1 with 16-element groups: each group's 16 weights are its scale, exactly
    args = (torch.ones(1, 16 * len(values), dtype=torch.int8).view(torch.uint8),
            torch.tensor([values], dtype=torch.float32), None, 16, False)
    dense = dequantize_packed(*args)
    for dtype in (torch.bfloat16, torch.float16):
        got = kernels.dequantize(*args, dtype)
        ref = dense.to(dtype)
        if dtype == torch.bfloat16 and "avx512_bf16" in BY_NAME[kernels.variant].requires:
            # vcvtneps2bf16 flushes fp32 subnormals (< 2^-126) to zero: no weight is that small
            ref = torch.where(dense.abs() < 2.0 ** -126, 0.0, dense).to(dtype)
        assert torch.equal(got, ref), f"{kernels.variant} {dtype}"  # as values: -0.0 may come back as +0.0


def test_int8_paths_of_avx2_and_avx512_agree():
    """The AVX2 (vpmaddubsw) and AVX512-VNNI (vpdpbusd) int8 paths round x alike: their outputs differ
    only in fp32 summation order. So do the exact paths."""
    for name in ("avx2", "avx512_bf16"):
        if not this_cpu().supports(BY_NAME[name]):
            pytest.skip(f"this CPU lacks {', '.join(_missing(name))}")
    avx2, avx512 = load_quant_kernels("avx2"), load_quant_kernels("avx512_bf16")
    assert avx2 is not None and avx512 is not None
    gen = torch.Generator().manual_seed(3)
    for q4, group, k, mins, f16 in FORMATS:
        w = Weight(q4, group, 50, k, mins, f16, seed=group + k + 2)
        for m in (1, 4, 5, 8, 19):
            x = torch.randn(m, k, generator=gen)
            a, b = avx2.quant_linear(x, *w.args()), avx512.quant_linear(x, *w.args())
            assert_fp32_close(a, b, f"exact g{group} M={m}", rel=2e-6)
            if group in (16, 32) or group % 64 == 0:
                a, b = avx2.quant_linear_vnni(x, *w.args()), avx512.quant_linear_vnni(x, *w.args())
                assert_fp32_close(a, b, f"int8 g{group} M={m}", rel=2e-6)


def test_256_and_512_bit_int8_tiles_agree(monkeypatch):
    """The AVX-512 build holds both int8 tile families (512-bit VNNI; 256-bit, taken on CPUs that split
    512-bit ops, such as AMD's Zen 4): FERRYLM_INT8_TILES forces each, and they differ only in fp32
    summation order, on every layout and row count (one chunk of 8 rows, several, a partial one)."""
    if not this_cpu().supports(BY_NAME["avx512_bf16"]):
        pytest.skip(f"this CPU lacks {', '.join(_missing('avx512_bf16'))}")
    kernels = load_quant_kernels("avx512_bf16")
    gen = torch.Generator().manual_seed(5)
    for q4, group, k, mins, f16 in FORMATS:
        if group not in (16, 32) and group % 64:
            continue
        w = Weight(q4, group, 45, k, mins, f16, seed=group + k + 7)
        for m in (1, 3, 8, 13):
            x = torch.randn(m, k, generator=gen)
            got = {}
            for width in ("256", "512"):
                monkeypatch.setenv("FERRYLM_INT8_TILES", width)
                got[width] = kernels.quant_linear_vnni(x, *w.args())
            assert_fp32_close(got["256"], got["512"], f"g{group} M={m}", rel=2e-6)
            assert_fp32_close(got["256"], F.linear(int8_rounded(x), w.dense), f"g{group} M={m} vs rounded x")
