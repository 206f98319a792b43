// Weight-only quantized matmul for the CPU: y = x W^T with W kept packed in memory.
//
// Every method (int8/int4 weight-only and the GGUF block formats, repacked at load) ends in one of two
// layouts, W [N, K] row-major in groups of G along K, w[n, k] = scale[n, g] * q[n, k] + min[n, g]:
//   q4: codes 0..15, 16 bytes per 32 elements, low nibble = element i, high nibble = element i + 16
//       (ggml's Q4_0 / Q4_1 block order, so those copy over byte for byte). G is a multiple of 32.
//   q8: int8 codes in natural order. G is a multiple of 16 (16 for Q6_K, 32 for Q8_0, K per channel).
// scale/min are fp16 or fp32 [N, K/G]; min may be absent (symmetric).
//
// Small batches (decode) are bandwidth-bound, so each weight byte is read once and widened in registers:
// a 4-bit code becomes its fp32 value by a 16-entry table lookup (vpermps reads only the low nibble), an
// int8 by a convert; the products with fp32 activations are exact FMAs and the group's partial sum is
// scaled once. The weights never exist in bf16. Measured on this project's CPU (AVX-512, 2 cores), that
// beat bf16 dot products (vdpbf16ps issues every other cycle there) and torch's int4 kernel.
// AVX2 builds (8 lanes, 16 registers) widen every code (q4 and q8) to fp32 and rebuild its exact weight
// with one FMA per 8: on the same CPU that ran 1.45x faster than a 16-entry lookup built from two
// vpermps and a blend (and vpermps has one port on Intel). The portable build is the scalar twin.
#include <ATen/Parallel.h>
#include <algorithm>
#include <vector>

#include "packed.h"

using namespace ferry_quant;

namespace {

// fp32 activations [M, K] and, when the weight has mins, their per-group sums [M, groups].
struct Acts {
  int64_t M, K;
  const float* x;
  const float* xg;
};

// sum over groups of min[n, g] * (sum of x over group g): the min term of every group at once.
inline float min_dot(const Packed& w, int64_t n, const float* xg) {
  int64_t g0 = 0;
  float s = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; g0 < w.groups; g0 += 16) {
    const __mmask16 k = static_cast<__mmask16>((1u << std::min<int64_t>(16, w.groups - g0)) - 1);
    const __m512 m = w.f16 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, static_cast<const at::Half*>(w.mins) + n * w.groups + g0))
                           : _mm512_maskz_loadu_ps(k, static_cast<const float*>(w.mins) + n * w.groups + g0);
    acc = _mm512_fmadd_ps(m, _mm512_maskz_loadu_ps(k, xg + g0), acc);
  }
  s = _mm512_reduce_add_ps(acc);
#else
  float buf[16];
  for (; g0 < w.groups; g0 += 16) {
    const int64_t c = std::min<int64_t>(16, w.groups - g0);
    stage(w.mins, w.f16, n, w.groups, g0, c, buf);
    for (int64_t i = 0; i < c; ++i) s += buf[i] * xg[g0 + i];
  }
#endif
  return s;
}

#if defined(__AVX512F__) || defined(FERRY_AVX2)
// Software prefetch distances, in bytes of codes ahead of the current load: a decode GEMV streams
// every weight once, and with rows of a few hundred bytes the hardware prefetcher alone falls behind
// (measured: up to 1.4x on lm_head-sized weights; 4 KB for q4 and 8 KB for q8 is the same distance in
// elements).
constexpr int64_t PREFETCH_Q4 = 4096, PREFETCH_Q8 = 8192, PREFETCH_SCALES = 512;

// Stage the fp32 scales / mins of groups [g0, g0 + gn) of row n, prefetching those further along.
inline void stage_group_terms(const Packed& w, int64_t n, int64_t g0, int64_t gn, float* sc, float* mn) {
  const int64_t at = (n * w.groups + g0) * (w.f16 ? 2 : 4);
  _mm_prefetch(static_cast<const char*>(w.scales) + at + PREFETCH_SCALES, _MM_HINT_T0);
  stage(w.scales, w.f16, n, w.groups, g0, gn, sc);
  if (mn == nullptr) return;
  if (w.mins) {
    _mm_prefetch(static_cast<const char*>(w.mins) + at + PREFETCH_SCALES, _MM_HINT_T0);
    stage(w.mins, w.f16, n, w.groups, g0, gn, mn);
  } else {
    std::memset(mn, 0, 16 * sizeof(float));
  }
}
#endif

#if defined(__AVX512F__)
#define FERRY_SIMD 1
// Whether a tile's result already holds the min term (else rows() adds min_dot over per-group x sums).
constexpr bool FOLDS_MINS_Q4 = true, FOLDS_MINS_Q8 = false;

// q4: out[m0 + m, n0 + j] for m < MB, j < NB, min term included. Per group and row, a 16-entry table
// holds the group's dequantized values (scale * q + min, exact fp32); vpermps looks each code up (it
// reads only the low 4 bits of a lane), so the scale and min cost one FMA per group, not per element.
template <int MB, int NB>
void tile_q4(const Packed& w, const Acts& a, int64_t m0, int64_t n0, float* out) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const int64_t blocks = w.G / 32;
  const float* x = a.x + m0 * a.K;
  __m512 acc[NB][MB][2];
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < MB; ++m) acc[j][m][0] = acc[j][m][1] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < w.groups; g0 += 16) {
    const int64_t gn = std::min<int64_t>(16, w.groups - g0);
    alignas(64) float sc[NB][16], mn[NB][16];
    for (int j = 0; j < NB; ++j) stage_group_terms(w, n0 + j, g0, gn, sc[j], mn[j]);
    for (int64_t gi = 0; gi < gn; ++gi) {
      __m512 lut[NB];
      for (int j = 0; j < NB; ++j) lut[j] = _mm512_fmadd_ps(iota, _mm512_set1_ps(sc[j][gi]), _mm512_set1_ps(mn[j][gi]));
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t k = (g0 + gi) * w.G + 32 * b;
        __m512 lo[NB], hi[NB];
        for (int j = 0; j < NB; ++j) {
          const uint8_t* p = w.codes + (n0 + j) * w.row_bytes + k / 2;
          if ((k & 127) == 0) _mm_prefetch(reinterpret_cast<const char*>(p) + PREFETCH_Q4, _MM_HINT_T0);
          const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
          lo[j] = _mm512_permutexvar_ps(c, lut[j]);
          hi[j] = _mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), lut[j]);
        }
        for (int m = 0; m < MB; ++m) {
          const __m512 x0 = _mm512_loadu_ps(x + m * a.K + k), x1 = _mm512_loadu_ps(x + m * a.K + k + 16);
          for (int j = 0; j < NB; ++j) {
            acc[j][m][0] = _mm512_fmadd_ps(lo[j], x0, acc[j][m][0]);
            acc[j][m][1] = _mm512_fmadd_ps(hi[j], x1, acc[j][m][1]);
          }
        }
      }
    }
  }
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < MB; ++m) out[m * 16 + j] = _mm512_reduce_add_ps(_mm512_add_ps(acc[j][m][0], acc[j][m][1]));
}

// q8: out[m0 + m, n0 + j] before the min term. Codes widen to fp32; each group's unscaled partial sum is
// scaled once. G16: 16-element groups (Q6_K), two scales per 32 elements.
template <bool G16, int MB, int NB>
void tile_q8(const Packed& w, const Acts& a, int64_t m0, int64_t n0, float* out) {
  constexpr int P = G16 ? 2 : 1;
  const int64_t step = G16 ? 2 : 1, blocks = G16 ? 1 : w.G / 32;
  const float* x = a.x + m0 * a.K;
  __m512 acc[NB][MB];
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < MB; ++m) acc[j][m] = _mm512_setzero_ps();
  for (int64_t g0 = 0; g0 < w.groups; g0 += 16) {
    const int64_t gn = std::min<int64_t>(16, w.groups - g0);
    alignas(64) float sc[NB][16];
    for (int j = 0; j < NB; ++j) stage_group_terms(w, n0 + j, g0, gn, sc[j], nullptr);
    for (int64_t gi = 0; gi < gn; gi += step) {
      __m512 p[NB][MB][P];
      for (int j = 0; j < NB; ++j)
        for (int m = 0; m < MB; ++m)
          for (int h = 0; h < P; ++h) p[j][m][h] = _mm512_setzero_ps();
      const int64_t kg = (g0 + gi) * (G16 ? 16 : w.G);
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t k = kg + 32 * b;
        __m512 lo[NB], hi[NB];
        for (int j = 0; j < NB; ++j) {
          const __m128i* q = reinterpret_cast<const __m128i*>(w.codes + (n0 + j) * w.row_bytes + k);
          if ((k & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(q) + PREFETCH_Q8, _MM_HINT_T0);
          lo[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q)));
          hi[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1)));
        }
        for (int m = 0; m < MB; ++m) {
          const __m512 x0 = _mm512_loadu_ps(x + m * a.K + k), x1 = _mm512_loadu_ps(x + m * a.K + k + 16);
          for (int j = 0; j < NB; ++j) {
            p[j][m][0] = _mm512_fmadd_ps(lo[j], x0, p[j][m][0]);
            p[j][m][P - 1] = _mm512_fmadd_ps(hi[j], x1, p[j][m][P - 1]);
          }
        }
      }
      for (int j = 0; j < NB; ++j) {
        const __m512 s0 = _mm512_set1_ps(sc[j][gi]);
        for (int m = 0; m < MB; ++m) acc[j][m] = _mm512_fmadd_ps(p[j][m][0], s0, acc[j][m]);
        if constexpr (G16) {
          const __m512 s1 = _mm512_set1_ps(sc[j][gi + 1]);
          for (int m = 0; m < MB; ++m) acc[j][m] = _mm512_fmadd_ps(p[j][m][1], s1, acc[j][m]);
        }
      }
    }
  }
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < MB; ++m) out[m * 16 + j] = _mm512_reduce_add_ps(acc[j][m]);
}
#elif defined(FERRY_AVX2)
#define FERRY_SIMD 1
constexpr bool FOLDS_MINS_Q4 = true, FOLDS_MINS_Q8 = true;

// One 32-element block at element k for rows n0.. of the tile: each code widens to fp32 and becomes its
// exact weight (scale * q + min, one FMA per 8: the twin's value), then meets the activations.
// gl / gh: the staged group of elements 0-15 / 16-31 (they differ only with 16-element groups).
template <bool Q4, int MB, int NB, int A>
inline void block_avx2(const Packed& w, const float* x, int64_t K, int64_t n0, int64_t k, int gl, int gh,
                       const float (*sc)[16], const float (*mn)[16], __m256 (*acc)[MB][A]) {
  for (int j = 0; j < NB; ++j) {
    const uint8_t* p = w.codes + (n0 + j) * w.row_bytes + (Q4 ? k / 2 : k);
    if ((k & (Q4 ? 127 : 63)) == 0)
      _mm_prefetch(reinterpret_cast<const char*>(p) + (Q4 ? PREFETCH_Q4 : PREFETCH_Q8), _MM_HINT_T0);
    __m256 v[4];
    widen32<Q4>(p, v);
    for (int i = 0; i < 4; ++i) {
      const int g = i < 2 ? gl : gh;
      const __m256 wv = _mm256_fmadd_ps(v[i], _mm256_set1_ps(sc[j][g]), _mm256_set1_ps(mn[j][g]));
      for (int m = 0; m < MB; ++m)
        acc[j][m][i % A] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k + 8 * i), acc[j][m][i % A]);
    }
  }
}

// out[m0 + m, n0 + j] for m < MB, j < NB, min term included (q4 and q8). With few outputs in flight each
// keeps two accumulators, so the FMA chains' latency stays hidden; at most 8 of the 16 ymm registers.
template <bool Q4, int MB, int NB>
void tile_avx2(const Packed& w, const Acts& a, int64_t m0, int64_t n0, float* out) {
  constexpr int A = NB * MB <= 4 ? 2 : 1;
  const float* x = a.x + m0 * a.K;
  __m256 acc[NB][MB][A];
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < MB; ++m)
      for (int h = 0; h < A; ++h) acc[j][m][h] = _mm256_setzero_ps();
  for (int64_t g0 = 0; g0 < w.groups; g0 += 16) {
    const int64_t gn = std::min<int64_t>(16, w.groups - g0);
    alignas(32) float sc[NB][16], mn[NB][16];
    for (int j = 0; j < NB; ++j) stage_group_terms(w, n0 + j, g0, gn, sc[j], mn[j]);
    if (w.G == 16) {  // two groups per block (Q6_K); groups come in pairs since K % 32 == 0
      for (int gi = 0; gi < gn; gi += 2)
        block_avx2<Q4, MB, NB, A>(w, x, a.K, n0, (g0 + gi) * 16, gi, gi + 1, sc, mn, acc);
      continue;
    }
    for (int gi = 0; gi < gn; ++gi)
      for (int64_t e = 0; e < w.G; e += 32)
        block_avx2<Q4, MB, NB, A>(w, x, a.K, n0, (g0 + gi) * w.G + e, gi, gi, sc, mn, acc);
  }
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < MB; ++m)
      out[m * 16 + j] = hsum(A == 2 ? _mm256_add_ps(acc[j][m][0], acc[j][m][A - 1]) : acc[j][m][0]);
}
#else
constexpr bool FOLDS_MINS_Q4 = false, FOLDS_MINS_Q8 = false;
#endif

// Portable path: one output at a time, the same arithmetic.
template <bool Q4>
float dot_scalar(const Packed& w, const float* x, int64_t K, int64_t n) {
  const uint8_t* row = w.codes + n * w.row_bytes;
  float v = 0.f, s[16];
  for (int64_t g = 0; g < w.groups; ++g) {
    if (g % 16 == 0) stage(w.scales, w.f16, n, w.groups, g, std::min<int64_t>(16, w.groups - g), s);
    float part = 0.f;
    for (int64_t k = g * w.G; k < (g + 1) * w.G; ++k) {
      float q;
      if constexpr (Q4) {
        const int64_t e = k & 31;
        const uint8_t byte = row[(k - e) / 2 + (e & 15)];
        q = static_cast<float>(e < 16 ? (byte & 0xF) : (byte >> 4));
      } else {
        q = static_cast<float>(reinterpret_cast<const int8_t*>(row)[k]);
      }
      part += q * x[k];
    }
    v += part * s[g % 16];
  }
  return v;
}

template <typename T>
inline void store(T* out, float v) { *out = static_cast<T>(v); }

// Output rows [n0, n1) (n1 - n0 <= 16) for every activation row, in row blocks of 8 and one block of
// the 1..7 left: each block is one pass over W's codes (their dequantizing lookups are the cost a pass
// repeats), so 3, 5, 6 or 7 rows (a decode row verifying a draft) take one pass, not 2 + 1 or 4 + 1.
template <bool Q4, typename T>
void rows(const Packed& w, const Acts& a, int64_t n0, int64_t n1, T* out, int64_t ldo) {
  alignas(64) float buf[8 * 16];
  for (int64_t m = 0; m < a.M;) {
    const int64_t mb = std::min<int64_t>(8, a.M - m);
#ifdef FERRY_SIMD
    auto run = [&](auto mb_tag, auto nb_tag) {
      constexpr int MB = decltype(mb_tag)::value, NB = decltype(nb_tag)::value;
      int64_t n = n0;
      auto one = [&](auto nb, int64_t at) {
        constexpr int B = decltype(nb)::value;
#if defined(FERRY_AVX2)
        tile_avx2<Q4, MB, B>(w, a, m, at, buf + (at - n0));
#else
        if constexpr (Q4) tile_q4<MB, B>(w, a, m, at, buf + (at - n0));
        else if (w.G == 16) tile_q8<true, MB, B>(w, a, m, at, buf + (at - n0));
        else tile_q8<false, MB, B>(w, a, m, at, buf + (at - n0));
#endif
      };
      for (; n + NB <= n1; n += NB) one(nb_tag, n);
      for (; n < n1; ++n) one(std::integral_constant<int, 1>{}, n);
    };
    using I1 = std::integral_constant<int, 1>;
    using I2 = std::integral_constant<int, 2>;
    using I4 = std::integral_constant<int, 4>;
    using I8 = std::integral_constant<int, 8>;
    // NB x MB x 2 accumulators (q4) stay within the 32 zmm registers
    switch (mb) {
      case 8: run(I8{}, I1{}); break;
      case 7: run(std::integral_constant<int, 7>{}, I1{}); break;
      case 6: run(std::integral_constant<int, 6>{}, I1{}); break;
      case 5: run(std::integral_constant<int, 5>{}, I1{}); break;
      case 4: run(I4{}, I2{}); break;
      case 3: run(std::integral_constant<int, 3>{}, I2{}); break;
      case 2: run(I2{}, I2{}); break;
      default: run(I1{}, I4{}); break;
    }
#else
    for (int64_t i = 0; i < mb; ++i)
      for (int64_t n = n0; n < n1; ++n) buf[i * 16 + (n - n0)] = dot_scalar<Q4>(w, a.x + (m + i) * a.K, a.K, n);
#endif
    for (int64_t i = 0; i < mb; ++i)
      for (int64_t n = n0; n < n1; ++n) {
        float v = buf[i * 16 + (n - n0)];
        if (w.mins && !(Q4 ? FOLDS_MINS_Q4 : FOLDS_MINS_Q8)) v += min_dot(w, n, a.xg + (m + i) * w.groups);
        store(out + (m + i) * ldo + n, v);
      }
    m += mb;
  }
}

}  // namespace

namespace ferry_quant {

Packed describe(const torch::Tensor& codes, const torch::Tensor& scales, const c10::optional<torch::Tensor>& mins,
                int64_t G) {
  return Packed{codes.data_ptr<uint8_t>(), codes.size(1), scales.data_ptr(),
                mins.has_value() ? mins->data_ptr() : nullptr, scales.size(1), G,
                scales.scalar_type() == at::kHalf, codes.size(0)};
}

void check(const torch::Tensor& codes, const torch::Tensor& scales, const c10::optional<torch::Tensor>& mins,
           int64_t K, int64_t G, bool q4) {
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.scalar_type() == at::kByte, "codes: uint8 [N, bytes]");
  TORCH_CHECK(codes.size(1) == (q4 ? K / 2 : K), "codes row length does not match in_features ", K);
  TORCH_CHECK(G > 0 && K % 32 == 0 && K % G == 0 && (q4 ? G % 32 == 0 : (G == 16 || G % 32 == 0)),
              "unsupported shape: in_features ", K, ", group ", G);
  TORCH_CHECK(scales.is_contiguous() && scales.dim() == 2 && scales.size(0) == codes.size(0) &&
              scales.size(1) == K / G, "scales: [N, K / group]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf, "scales: fp32 or fp16");
  if (mins.has_value())
    TORCH_CHECK(mins->sizes() == scales.sizes() && mins->scalar_type() == scales.scalar_type() &&
                mins->is_contiguous(), "mins: like scales");
}

}  // namespace ferry_quant

// y[M, N] = x[M, K] @ W^T, W packed (see the top of this file); y has x's dtype.
torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                           const c10::optional<torch::Tensor>& mins, int64_t group_size, bool q4) {
  TORCH_CHECK(x.dim() == 2, "x: [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  check(codes, scales, mins, K, group_size, q4);
  const Packed w = describe(codes, scales, mins, group_size);
  const torch::Tensor xf = x.to(at::kFloat).contiguous();
  // Per-group activation sums, for the min term where the tiles do not fold it into the weights.
  const bool sums = mins.has_value() && !(q4 ? FOLDS_MINS_Q4 : FOLDS_MINS_Q8);
  std::vector<float> xg(sums ? M * w.groups : 0, 0.f);
  const float* xp = xf.data_ptr<float>();
  for (int64_t m = 0; m < M && sums; ++m)
    for (int64_t g = 0; g < w.groups; ++g)
      for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k) xg[m * w.groups + g] += xp[m * K + k];
  const Acts a{M, K, xp, xg.data()};
  torch::Tensor out = torch::empty({M, N}, x.options());
  // Tiles of 16 output rows: their codes stay in L1 while every activation block passes over them.
  constexpr int64_t TILE = 16;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quant_linear", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, (N + TILE - 1) / TILE, 4, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t lo = t * TILE, hi = std::min(N, lo + TILE);
        if (q4) rows<true>(w, a, lo, hi, op, N);
        else rows<false>(w, a, lo, hi, op, N);
      }
    });
  });
  return out;
}

// 32 fp32 values into dst as T, rounded to nearest even as c10 does.
template <typename T>
inline void store32(const float* row, T* dst) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(row)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(row + 16)));
    return;
  }
#endif
#if defined(FERRY_YMM)
  if constexpr (std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half>) {  // F16C rounds as c10 does
    for (int i = 0; i < 4; ++i) {
      const __m256 v = _mm256_load_ps(row + 8 * i);
      const __m128i h = std::is_same_v<T, at::Half> ? _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT) : to_bf16(v);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 8 * i), h);
    }
    return;
  }
#endif
  for (int e = 0; e < 32; ++e) dst[e] = static_cast<T>(row[e]);
}

// Unpack W into `out` [N, K] (float dtype, contiguous): the large-batch path unpacks a panel of rows
// into a reused buffer and runs one GEMM on it; embedding lookups unpack the rows they need.
void dequantize_into(const torch::Tensor& codes, const torch::Tensor& scales, const c10::optional<torch::Tensor>& mins,
                     int64_t group_size, bool q4, torch::Tensor& out) {
  const int64_t N = codes.size(0), K = q4 ? codes.size(1) * 2 : codes.size(1);
  check(codes, scales, mins, K, group_size, q4);
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == N && out.size(1) == K, "out: [N, K] contiguous");
  const Packed w = describe(codes, scales, mins, group_size);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "dequantize", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      std::vector<float> s(w.groups + 16), z(w.groups + 16);
      alignas(64) float row[32];
      for (int64_t n = n0; n < n1; ++n) {
        stage_row(w, n, s.data(), z.data());
        for_each_block(w, K, [&](int64_t k, int64_t g) {
          scalar_t* dst = o + n * K + k;
          const bool half = w.G == 16;
          if constexpr (std::is_same_v<scalar_t, float>) {
            unpack32(w, q4, n, k, s.data() + g, z.data() + g, half, reinterpret_cast<float*>(dst));
            return;
          }
          unpack32(w, q4, n, k, s.data() + g, z.data() + g, half, row);
          store32(row, dst);
        });
      }
    });
  });
}

torch::Tensor dequantize(const torch::Tensor& codes, const torch::Tensor& scales,
                         const c10::optional<torch::Tensor>& mins, int64_t group_size, bool q4,
                         at::ScalarType dtype) {
  torch::Tensor out = torch::empty({codes.size(0), q4 ? codes.size(1) * 2 : codes.size(1)},
                                   codes.options().dtype(dtype));
  dequantize_into(codes, scales, mins, group_size, q4, out);
  return out;
}

// The large-batch path for bf16 activations on AMX (amx_linear.cpp); see has_amx().
torch::Tensor quant_linear_amx(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                               const c10::optional<torch::Tensor>& mins, int64_t group_size, bool q4) {
  TORCH_CHECK(x.dim() == 2, "x: [M, K]");
  check(codes, scales, mins, x.size(1), group_size, q4);
  return amx_linear(x.contiguous(), describe(codes, scales, mins, group_size), q4);
}

// torch ops (torch.ops.ferrylm.*), so a compiled decode step traces through them as one graph; their
// fake kernels are registered in quant/kernels.py. The has_* queries take no tensor: catch-all kernels.
TORCH_LIBRARY_FRAGMENT(FERRY_LIB, m) {
  m.def("quant_linear(Tensor x, Tensor codes, Tensor scales, Tensor? mins, int group_size, bool q4) -> Tensor");
  m.def("quant_linear_amx(Tensor x, Tensor codes, Tensor scales, Tensor? mins, int group_size, bool q4) -> Tensor");
  m.def("quant_dequantize(Tensor codes, Tensor scales, Tensor? mins, int group_size, bool q4, ScalarType dtype) "
        "-> Tensor");
  m.def("quant_dequantize_into(Tensor codes, Tensor scales, Tensor? mins, int group_size, bool q4, "
        "Tensor(a!) out) -> ()");
  m.def("quant_has_amx() -> bool", &amx_available);    // AMX tile instructions run here
  m.def("quant_has_vnni() -> bool", &vnni_available);  // quant_linear_vnni (int8 activations) runs here
}

TORCH_LIBRARY_IMPL(FERRY_LIB, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_linear_amx", &quant_linear_amx);
  m.impl("quant_dequantize", &dequantize);
  m.impl("quant_dequantize_into", &dequantize_into);
}
