// Decode-sized matmuls (a few activation rows) with int8 activations and VNNI dot products.
//
// The exact path (quant_gemm.cpp) widens every weight code to fp32 and spends ~7 instructions per 32
// weights, three of them on the one shuffle port: on this project's 2-core CPU that made a Q4_1 GEMV
// compute-bound at ~3.7 GB/s per core. Here, as llama.cpp does for its Q4/Q8 formats, each 32-element
// block of x is quantized to int8 once per call (scale amax / 127, round to nearest), and one vpdpbusd
// multiplies 64 weight codes by 64 activation codes into int32 lanes; a lane's sum is scaled by its
// block's weight scale times x's block scale. The min term (sum over groups of min * sum of x) sums the
// quantized x too (llama.cpp's Q8_1 "s"), so the result is exactly the dequantized weight times the
// rounded x: its error is sum |w| * |x - xq| <= sum |w| * amax / 254. (Exact sums of x there were
// worse: Q4_1's min is ~ -8 scales, so scale * q and min nearly cancel, and rounding only one of the
// two leaves an error of the size of scale * q, several times |w|.)
//
// Supported: q4 and q8 codes with groups of exactly 32 or a multiple of 64 elements (Q4_0, Q4_1, Q4_K,
// Q5_K, Q8_0, int4-g32..g256, int8 per channel). Q6_K's 16-element groups keep the exact path.
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

#include "packed.h"

namespace ferry_quant {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define FERRY_VNNI 1

namespace {

constexpr int64_t MAX_ROWS = 4;  // activation rows per call (the decode path); more go elsewhere

// x quantized per 32-element block, arranged pair by pair (64 codes per pair of blocks) in the order the
// weight codes of that pair are laid out in a 512-bit register:
//   q4: [b0 e0-15 | b1 e0-15 | b0 e16-31 | b1 e16-31]  (low nibbles of the pair's 32 bytes, then high)
//   q8: [b0 e0-31 | b1 e0-31]                          (codes in natural order)
// dx: the blocks' scales; gsum: sums of the rounded x per weight group (for the min term).
struct QuantizedActs {
  int64_t M, K, blocks, pairs, groups;
  std::vector<int8_t> xq;  // [M, pairs * 64]
  std::vector<float> dx;   // [M, pairs * 2] (a missing last block: 0)
  std::vector<float> gsum; // [M, groups]
};

QuantizedActs quantize_acts(const float* x, int64_t M, int64_t K, int64_t G, bool q4) {
  QuantizedActs a;
  a.M = M, a.K = K, a.blocks = K / 32, a.pairs = (K / 32 + 1) / 2, a.groups = K / G;
  a.xq.assign(M * a.pairs * 64, 0);
  a.dx.assign(M * a.pairs * 2, 0.f);
  a.gsum.assign(M * a.groups, 0.f);
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    for (int64_t b = 0; b < a.blocks; ++b) {
      const __m512 v0 = _mm512_loadu_ps(xr + 32 * b), v1 = _mm512_loadu_ps(xr + 32 * b + 16);
      const float amax = std::max(_mm512_reduce_max_ps(_mm512_abs_ps(v0)), _mm512_reduce_max_ps(_mm512_abs_ps(v1)));
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      // cvtps_epi32 rounds to nearest even (MXCSR default); |values| <= 127 so the int8 pack is exact.
      const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
      const __m128i q0 = _mm512_cvtsepi32_epi8(i0), q1 = _mm512_cvtsepi32_epi8(i1);
      const int64_t p = b / 2, half = b % 2;
      int8_t* dst = a.xq.data() + (m * a.pairs + p) * 64;
      if (q4) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16 * half), q0);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 32 + 16 * half), q1);
      } else {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 32 * half), q0);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 32 * half + 16), q1);
      }
      a.dx[(m * a.pairs + p) * 2 + half] = amax / 127.f;
      a.gsum[m * a.groups + (32 * b) / G] += amax / 127.f * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1)));
    }
  }
  return a;
}

// The 64 weight codes of pair p of row n, as unsigned bytes (q4) or signed (q8) in the order above.
// A pair past the row's last block (odd block count) reads only the first half.
inline __m512i load_pair_q4(const uint8_t* row, int64_t p, bool tail) {
  const __m256i raw = tail ? _mm256_maskz_loadu_epi8(0xFFFF, row + 32 * p)
                           : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * p));
  const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(raw), raw, 1);
  // Low half: shift 0; high half: shift 4 (per 16-bit lane), then keep the low nibble of every byte.
  const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  return _mm512_and_si512(_mm512_srlv_epi16(both, shifts), _mm512_set1_epi8(0x0F));
}

inline __m512i load_pair_q8(const uint8_t* row, int64_t p, bool tail) {
  return tail ? _mm512_maskz_loadu_epi8(0xFFFFFFFFull, row + 64 * p)
              : _mm512_loadu_si512(reinterpret_cast<const void*>(row + 64 * p));
}

// q8 codes are signed: vpdpbusd wants one unsigned operand, so multiply |w| by x carrying w's sign.
inline __m512i dot_q8(__m512i acc, __m512i w, __m512i xq) {
  const __mmask64 neg = _mm512_movepi8_mask(w);
  return _mm512_dpbusd_epi32(acc, _mm512_abs_epi8(w), _mm512_mask_sub_epi8(xq, neg, _mm512_setzero_si512(), xq));
}

// Lane pattern of a pair's two blocks: q4 [b0 x4, b1 x4, b0 x4, b1 x4], q8 [b0 x8, b1 x8].
inline __m512i lane_blocks(bool q4) {
  return q4 ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1)
            : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
}

// Output rows n0..n0+NB-1 for activation rows 0..MB-1: sum of q.x per lane, scaled. MB and NB are
// template arguments so the accumulators stay in registers (with a runtime row count they went to the
// stack, and every FMA waited on a store-to-load round trip: 4x slower).
template <bool Q4, int NB, int MB>
void tile(const Packed& w, const QuantizedActs& a, int64_t n0, float* out /* [MB, 16] */) {
  const __m512i lanes = lane_blocks(Q4);
  __m512 acc[NB][MB];
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < MB; ++m) acc[j][m] = _mm512_setzero_ps();
  const uint8_t* rows[NB];
  for (int j = 0; j < NB; ++j) rows[j] = w.codes + (n0 + j) * w.row_bytes;
  const int64_t pairs_per_group = w.G == 32 ? 0 : w.G / 64;
  alignas(64) float sc[NB][16];
  __m512 gacc[NB][MB];
  for (int64_t p = 0; p < a.pairs; ++p) {
    const bool tail = 2 * p + 1 >= a.blocks;
    if (w.G == 32 && p % 8 == 0) {  // stage 16 groups (8 pairs) of scales at a time
      const int64_t gn = std::min<int64_t>(16, w.groups - 2 * p);
      for (int j = 0; j < NB; ++j) stage(w.scales, w.f16, n0 + j, w.groups, 2 * p, gn, sc[j]);
    }
    if (pairs_per_group && p % pairs_per_group == 0)
      for (int j = 0; j < NB; ++j)
        for (int m = 0; m < MB; ++m) gacc[j][m] = _mm512_setzero_ps();
    __m512i wv[NB];
    for (int j = 0; j < NB; ++j) {
      if (p % 4 == 0) _mm_prefetch(reinterpret_cast<const char*>(rows[j] + (Q4 ? 32 : 64) * p) + 2048, _MM_HINT_T0);
      wv[j] = Q4 ? load_pair_q4(rows[j], p, tail) : load_pair_q8(rows[j], p, tail);
    }
    for (int m = 0; m < MB; ++m) {
      const __m512i xq = _mm512_loadu_si512(a.xq.data() + (m * a.pairs + p) * 64);
      const float* dxp = a.dx.data() + (m * a.pairs + p) * 2;
      const __m512 dx = _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(_mm_setr_ps(dxp[0], dxp[1], 0, 0)));
      for (int j = 0; j < NB; ++j) {
        const __m512i dp = Q4 ? _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[j], xq)
                              : dot_q8(_mm512_setzero_si512(), wv[j], xq);
        const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(dp), dx);
        if (w.G == 32) {  // per-block weight scale: lanes pick theirs from the staged 16
          const __m512i idx = _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int>(2 * (p % 8))));
          acc[j][m] = _mm512_fmadd_ps(f, _mm512_permutexvar_ps(idx, _mm512_load_ps(sc[j])), acc[j][m]);
        } else {
          gacc[j][m] = _mm512_add_ps(gacc[j][m], f);
        }
      }
    }
    if (pairs_per_group && (p + 1) % pairs_per_group == 0) {
      const int64_t g = p / pairs_per_group;
      for (int j = 0; j < NB; ++j) {
        float s;
        stage(w.scales, w.f16, n0 + j, w.groups, g, 1, &s);
        for (int m = 0; m < MB; ++m) acc[j][m] = _mm512_fmadd_ps(gacc[j][m], _mm512_set1_ps(s), acc[j][m]);
      }
    }
  }
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < MB; ++m) out[m * 16 + j] = _mm512_reduce_add_ps(acc[j][m]);
}

template <bool Q4, int NB>
void tile_rows(const Packed& w, const QuantizedActs& a, int64_t n0, float* out) {
  switch (a.M) {
    case 1: tile<Q4, NB, 1>(w, a, n0, out); break;
    case 2: tile<Q4, NB, 2>(w, a, n0, out); break;
    case 3: tile<Q4, NB, 3>(w, a, n0, out); break;
    default: tile<Q4, NB, 4>(w, a, n0, out); break;
  }
}

inline float min_term(const Packed& w, int64_t n, const float* gsum) {
  float s = 0.f, buf[16];
  for (int64_t g0 = 0; g0 < w.groups; g0 += 16) {
    const int64_t c = std::min<int64_t>(16, w.groups - g0);
    stage(w.mins, w.f16, n, w.groups, g0, c, buf);
    for (int64_t i = 0; i < c; ++i) s += buf[i] * gsum[g0 + i];
  }
  return s;
}

}  // namespace
#endif

bool vnni_available() {
#ifdef FERRY_VNNI
  return true;
#else
  return false;
#endif
}

}  // namespace ferry_quant

using namespace ferry_quant;

// y[M, N] = x[M, K] @ W^T with x quantized to int8 per 32-element block; M <= 4, W packed with groups
// of 32 or a multiple of 64. y has x's dtype.
torch::Tensor quant_linear_vnni(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                                const c10::optional<torch::Tensor>& mins, int64_t group_size, bool q4) {
  TORCH_CHECK(x.dim() == 2, "x: [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  check(codes, scales, mins, K, group_size, q4);
#ifdef FERRY_VNNI
  TORCH_CHECK(M <= MAX_ROWS, "quant_linear_vnni: at most ", MAX_ROWS, " activation rows, got ", M);
  TORCH_CHECK(group_size == 32 || group_size % 64 == 0, "quant_linear_vnni: group ", group_size, " unsupported");
  if (M == 0) return torch::empty({0, N}, x.options());  // no rows (a step that samples none): the tiles read row 0
  const Packed w = describe(codes, scales, mins, group_size);
  // x widened here, not by x.to(float): that was one more dispatched op (~4 us) per call, 120 a step.
  const torch::Tensor xc = x.contiguous();
  std::vector<float> xf(M * K);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quant_linear_vnni_x", [&] {
    const scalar_t* src = xc.data_ptr<scalar_t>();
    for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(src[i]);
  });
  const QuantizedActs a = quantize_acts(xf.data(), M, K, group_size, q4);
  torch::Tensor out = torch::empty({M, N}, x.options());
  constexpr int64_t TILE = 16;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quant_linear_vnni", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, (N + TILE - 1) / TILE, 4, [&](int64_t t0, int64_t t1) {
      alignas(64) float buf[MAX_ROWS * 16];
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t lo = t * TILE, hi = std::min(N, lo + TILE);
        int64_t n = lo;
        for (; n + 4 <= hi; n += 4) {
          if (q4) tile_rows<true, 4>(w, a, n, buf + (n - lo) % 16);
          else tile_rows<false, 4>(w, a, n, buf + (n - lo) % 16);
        }
        for (; n < hi; ++n) {
          if (q4) tile_rows<true, 1>(w, a, n, buf + (n - lo) % 16);
          else tile_rows<false, 1>(w, a, n, buf + (n - lo) % 16);
        }
        for (int64_t m = 0; m < M; ++m)
          for (int64_t r = lo; r < hi; ++r) {
            float v = buf[m * 16 + (r - lo)];
            if (w.mins) v += min_term(w, r, a.gsum.data() + m * a.groups);
            op[m * N + r] = static_cast<scalar_t>(v);
          }
      }
    });
  });
  return out;
#else
  TORCH_CHECK(false, "quant_linear_vnni: built without AVX512-VNNI");
#endif
}

TORCH_LIBRARY_FRAGMENT(ferrylm, m) {
  m.def("quant_linear_vnni(Tensor x, Tensor codes, Tensor scales, Tensor? mins, int group_size, bool q4) -> Tensor");
}

TORCH_LIBRARY_IMPL(ferrylm, CPU, m) { m.impl("quant_linear_vnni", &quant_linear_vnni); }
