// Decode-sized matmuls (a few activation rows) with int8 activations and integer dot products.
//
// The exact path (quant_gemm.cpp) widens every weight code to fp32 and spends ~7 instructions per 32
// weights, three of them on the one shuffle port: on this project's 2-core CPU that made a Q4_1 GEMV
// compute-bound at ~3.7 GB/s per core. Here, as llama.cpp does for its Q4/Q8 formats, each 32-element
// block of x is quantized to int8 once per call (scale amax / 127, round to nearest), and integer dot
// products multiply weight codes by activation codes into int32 lanes: one vpdpbusd per 64 codes with
// AVX512-VNNI, vpmaddubsw + vpmaddwd per 32 on AVX2 (and AVX-512 without VNNI). A lane's sum is scaled
// by its block's weight scale times x's block scale. The min term (sum over groups of min * sum of x)
// sums the quantized x too (llama.cpp's Q8_1 "s"), so the result is exactly the dequantized weight times
// the rounded x: its error is sum |w| * |x - xq| <= sum |w| * amax / 254. (Exact sums of x there were
// worse: Q4_1's min is ~ -8 scales, so scale * q and min nearly cancel, and rounding only one of the
// two leaves an error of the size of scale * q, several times |w|.) Both ISAs round x alike, so they
// differ only in fp32 summation order.
//
// Supported: q4 and q8 codes with groups of 16 (q8: Q6_K), 32 or a multiple of 64 elements (Q4_0,
// Q4_1, Q4_K, Q5_K, Q8_0, int4-g32..g256, int8 per channel when K is a multiple of 64); any number of
// activation rows, 8 at a time per weight tile (packed.py decides up to how many rows this path wins).
// On ARM (the neon variant) the op runs neon_gemv.h, the same arithmetic with SDOT or SMULL + SADALP
// (any q4 group that is a multiple of 32; q8 groups of 16 too).
#include <ATen/Parallel.h>

#include "int8_tiles.h"
#include "neon_gemv.h"

namespace ferry_quant {

bool vnni_available() {
#ifdef FERRY_INT8
  return true;
#elif defined(__ARM_NEON) && !defined(FERRY_PORTABLE)
  return true;  // quant_linear_vnni runs neon_gemv.h
#else
  return false;
#endif
}

}  // namespace ferry_quant

using namespace ferry_quant;

#if !defined(FERRY_INT8) && defined(__ARM_NEON) && !defined(FERRY_PORTABLE)
// quant_linear_vnni on ARM: x widened to fp32 and quantized once, output rows split across threads
// (16 at a time), y converted to x's dtype. The NEON kernel takes GEMV_MAX_ROWS activation rows at a
// time: more are run in chunks of that many.
static torch::Tensor linear_neon(const torch::Tensor& x, const Packed& w, int64_t group_size, bool q4) {
  const int64_t M = x.size(0), K = x.size(1), N = w.rows;
  TORCH_CHECK(ferry_neon::gemv_supports(q4, K, group_size), "quant_linear_vnni: group ", group_size, " unsupported");
  torch::Tensor out = torch::empty({M, N}, x.options());
  if (M == 0) return out;
  const std::vector<float> xf = widened(x);
  std::vector<float> yf(M * N);
  const ferry_neon::PackedWeights nw{w.codes, w.row_bytes, w.scales, w.mins, w.groups, group_size, w.f16, q4};
  for (int64_t m0 = 0; m0 < M; m0 += ferry_neon::GEMV_MAX_ROWS) {
    const int64_t rows = std::min<int64_t>(ferry_neon::GEMV_MAX_ROWS, M - m0);
    const ferry_neon::Int8Acts a = ferry_neon::quantize_acts(xf.data() + m0 * K, rows, K, group_size);
    float* y = yf.data() + m0 * N;
    at::parallel_for(0, (N + 15) / 16, 4, [&](int64_t t0, int64_t t1) {
      ferry_neon::gemv_rows(nw, a, 16 * t0, std::min(N, 16 * t1), y, N);
    });
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quant_linear_neon_y", [&] {
    scalar_t* dst = out.data_ptr<scalar_t>();
    for (int64_t i = 0; i < M * N; ++i) dst[i] = static_cast<scalar_t>(yf[i]);
  });
  return out;
}
#endif

// y[M, N] = x[M, K] @ W^T with x quantized to int8 per 32-element block, W packed with groups of 16 (q8),
// 32 or a multiple of 64; any M: a thread takes 16 weight rows at a time and multiplies them with every
// chunk of MAX_ROWS activation rows while they sit in L1. y has x's dtype.
torch::Tensor quant_linear_vnni(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                                const c10::optional<torch::Tensor>& mins, int64_t group_size, bool q4) {
  TORCH_CHECK(x.dim() == 2, "x: [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  check(codes, scales, mins, K, group_size, q4);
#ifdef FERRY_INT8
  TORCH_CHECK(group_size == 16 || group_size == 32 || group_size % 64 == 0, "quant_linear_vnni: group ",
              group_size, " unsupported");
  if (M == 0) return torch::empty({0, N}, x.options());  // no rows (a step that samples none): the tiles read row 0
  const Packed w = describe(codes, scales, mins, group_size);
  const std::vector<float> xf = widened(x);  // not x.to(float): one more dispatched op (~4 us) per call
  const bool wide = use_zmm();
  const QuantizedActs a = quantize_acts(xf.data(), M, K, group_size, q4, wide);
  torch::Tensor out = torch::empty({M, N}, x.options());
  constexpr int64_t TILE = 16;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quant_linear_vnni", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, (N + TILE - 1) / TILE, 4, [&](int64_t t0, int64_t t1) {
      alignas(64) float buf[MAX_ROWS * 16];
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t lo = t * TILE, hi = std::min(N, lo + TILE);
        // every chunk of up to MAX_ROWS activation rows against this tile's weight rows (still in L1)
        for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
          const Acts rows = rows_of(a, m0, std::min(MAX_ROWS, M - m0));
          tile_span(wide, q4, w, rows, lo, hi, buf);
          for (int64_t m = 0; m < rows.M; ++m)
            for (int64_t r = lo; r < hi; ++r) op[(m0 + m) * N + r] = static_cast<scalar_t>(buf[m * 16 + (r - lo)]);
        }
      }
    });
  });
  return out;
#elif defined(__ARM_NEON) && !defined(FERRY_PORTABLE)
  return linear_neon(x, describe(codes, scales, mins, group_size), group_size, q4);
#else
  TORCH_CHECK(false, "quant_linear_vnni: built without int8 dot products (AVX2, AVX512-VNNI or ARM NEON)");
#endif
}

TORCH_LIBRARY_FRAGMENT(FERRY_LIB, m) {
  m.def("quant_linear_vnni(Tensor x, Tensor codes, Tensor scales, Tensor? mins, int group_size, bool q4) -> Tensor");
}

TORCH_LIBRARY_IMPL(FERRY_LIB, CPU, m) { m.impl("quant_linear_vnni", &quant_linear_vnni); }
