// Shared by the quantized-matmul sources: the packed weight layout and how to read it.
#pragma once
#include "../../csrc/torch_lite.h"
#include <cstring>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
// FERRY_YMM: the 8-wide helpers below compile. FERRY_AVX2: they are this build's widest (Haswell, Zen 1-3),
// so its kernels take the AVX2 paths; AVX-512 builds have their own.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define FERRY_YMM 1
#if !defined(__AVX512F__)
#define FERRY_AVX2 1
#endif
#endif

namespace ferry_quant {

inline float to_f(float v) { return v; }
// c10's Half -> float is a bit-twiddling routine; F16C does it in one instruction.
inline float to_f(at::Half v) {
#if defined(__F16C__)
  return _cvtsh_ss(v.x);
#else
  return static_cast<float>(v);
#endif
}

struct Packed {
  const uint8_t* codes;
  int64_t row_bytes;  // bytes of codes per output row
  const void* scales;
  const void* mins;   // nullptr: symmetric
  int64_t groups;     // groups per row (K / G)
  int64_t G;
  bool f16;           // scale/min dtype
  int64_t rows;       // N, output features
};

#ifdef FERRY_YMM
// n values at p (fp16 or fp32) as fp32 in one register, zero past n (n >= 8: the first 8). A short run is
// gathered in the register, not through memory: a vector load of floats stored one by one waits for
// those stores to retire (store forwarding fails), which cost short rows ~1.3x.
inline __m256 load8(const void* p, bool f16, int64_t n) {
  if (!f16) {
    if (n >= 8) return _mm256_loadu_ps(static_cast<const float*>(p));
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(static_cast<const float*>(p), _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), lane));
  }
  const uint16_t* q = static_cast<const uint16_t*>(p);
  if (n >= 8) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  __m128i h = _mm_setzero_si128();
  switch (n) {  // no masked 16-bit loads before AVX-512
    case 7: h = _mm_insert_epi16(h, q[6], 6); [[fallthrough]];
    case 6: h = _mm_insert_epi16(h, q[5], 5); [[fallthrough]];
    case 5: h = _mm_insert_epi16(h, q[4], 4); [[fallthrough]];
    case 4: h = _mm_insert_epi16(h, q[3], 3); [[fallthrough]];
    case 3: h = _mm_insert_epi16(h, q[2], 2); [[fallthrough]];
    case 2: h = _mm_insert_epi16(h, q[1], 1); [[fallthrough]];
    case 1: h = _mm_insert_epi16(h, q[0], 0); [[fallthrough]];
    default: break;
  }
  return _mm256_cvtph_ps(h);
}
#endif

// Scale (or min) of groups [g0, g0 + n) of row `row` as fp32, into `dst` (n <= 16). SIMD builds write
// whole vectors, zero past n: up to the next multiple of 8 (AVX2), or all 16 (AVX-512).
inline void stage(const void* base, bool f16, int64_t row, int64_t groups, int64_t g0, int64_t n, float* dst) {
  const int64_t at = row * groups + g0;
#if defined(__AVX512F__)
  const __mmask16 k = static_cast<__mmask16>((1u << n) - 1);
  _mm512_storeu_ps(dst, f16 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, static_cast<const at::Half*>(base) + at))
                            : _mm512_maskz_loadu_ps(k, static_cast<const float*>(base) + at));
#elif defined(FERRY_YMM)
  const int64_t size = f16 ? 2 : 4;
  for (int64_t i = 0; i < n; i += 8)
    _mm256_storeu_ps(dst + i, load8(static_cast<const char*>(base) + (at + i) * size, f16, n - i));
#else
  if (!f16) {
    std::memcpy(dst, static_cast<const float*>(base) + at, n * sizeof(float));
    return;
  }
  const at::Half* p = static_cast<const at::Half*>(base) + at;
  for (int64_t i = 0; i < n; ++i) dst[i] = to_f(p[i]);
#endif
}

#ifdef FERRY_YMM
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// The 32 codes of one block as fp32, v[i] = elements 8i..8i+7 (q4: 16 bytes at p, low nibbles are
// elements 0-15, high 16-31; q8: 32 signed bytes). Each byte is read once, widened in registers.
template <bool Q4>
inline void widen32(const uint8_t* p, __m256 v[4]) {
  if constexpr (Q4) {
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
    const __m256i low = _mm256_set1_epi32(0xF);
    v[0] = _mm256_cvtepi32_ps(_mm256_and_si256(b0, low));
    v[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b1, low));
    v[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
    v[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
  } else {
    for (int i = 0; i < 4; ++i)
      v[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i))));
  }
}

// 8 floats to bf16, rounded to nearest even as c10 does (NaN stays a quiet NaN): without AVX512-BF16,
// add 0x7FFF plus the lowest kept bit and drop the low 16 bits.
inline __m128i to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  // packus works within 128-bit lanes: [0-3 | 0-3 | 4-7 | 4-7] as 16-bit, then gather the two halves
  const __m256i packed = _mm256_packus_epi32(r, r);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}
#endif

// Elements [k, k + 32) of row n as fp32 (scale * q + min), the values the matmul multiplies with.
// `s` / `z` point at the staged fp32 scale / min of the group holding element k (z all zero when
// symmetric); with 16-element groups (`half`), elements k + 16.. use the next group's.
inline void unpack32(const Packed& w, bool q4, int64_t n, int64_t k, const float* s, const float* z, bool half,
                     float* dst) {
  const uint8_t* c = w.codes + n * w.row_bytes;
  const int h = half ? 1 : 0;
#if defined(__AVX512F__)
  __m512 lo, hi;
  if (q4) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + k / 2)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0xF)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
  } else {
    const __m128i* q = reinterpret_cast<const __m128i*>(c + k);
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q)));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1)));
  }
  _mm512_storeu_ps(dst, _mm512_fmadd_ps(lo, _mm512_set1_ps(s[0]), _mm512_set1_ps(z[0])));
  _mm512_storeu_ps(dst + 16, _mm512_fmadd_ps(hi, _mm512_set1_ps(s[h]), _mm512_set1_ps(z[h])));
#elif defined(FERRY_AVX2)
  __m256 v[4];
  if (q4) widen32<true>(c + k / 2, v);
  else widen32<false>(c + k, v);
  for (int i = 0; i < 4; ++i) {
    const int g = i < 2 ? 0 : h;
    _mm256_storeu_ps(dst + 8 * i, _mm256_fmadd_ps(v[i], _mm256_set1_ps(s[g]), _mm256_set1_ps(z[g])));
  }
#else
  for (int e = 0; e < 32; ++e) {
    const float q = q4 ? static_cast<float>(e < 16 ? (c[k / 2 + e] & 0xF) : (c[k / 2 + e - 16] >> 4))
                       : static_cast<float>(reinterpret_cast<const int8_t*>(c)[k + e]);
    const int g = e < 16 ? 0 : h;
    dst[e] = q * s[g] + z[g];
  }
#endif
}

// Calls fn(k, g) for each 32-element block of a row: k its first element, g the group of element k.
template <typename Fn>
inline void for_each_block(const Packed& w, int64_t K, Fn&& fn) {
  if (w.G == 16) {
    for (int64_t k = 0; k < K; k += 32) fn(k, k / 16);
    return;
  }
  for (int64_t g = 0, k = 0; g < w.groups; ++g)
    for (int64_t e = 0; e < w.G; e += 32, k += 32) fn(k, g);
}

// Row n's scales and mins as fp32 into s / z (each w.groups + 16 long: stage() writes 16 at a time).
inline void stage_row(const Packed& w, int64_t n, float* s, float* z) {
  for (int64_t g0 = 0; g0 < w.groups; g0 += 16) {
    const int64_t cnt = std::min<int64_t>(16, w.groups - g0);
    stage(w.scales, w.f16, n, w.groups, g0, cnt, s + g0);
    if (w.mins) stage(w.mins, w.f16, n, w.groups, g0, cnt, z + g0);
    else std::memset(z + g0, 0, 16 * sizeof(float));
  }
}

// t's values as float32, row-major: what t.to(float) computes, without dispatching an op (~2-4 us a call,
// and the decode step calls these kernels a few hundred times).
inline std::vector<float> widened(const torch::Tensor& t) {
  const torch::Tensor c = t.contiguous();
  std::vector<float> out(c.numel());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, c.scalar_type(), "ferry_quant_widened", [&] {
    const scalar_t* src = c.data_ptr<scalar_t>();
    for (int64_t i = 0; i < c.numel(); ++i) out[i] = static_cast<float>(src[i]);
  });
  return out;
}

Packed describe(const torch::Tensor& codes, const torch::Tensor& scales, const c10::optional<torch::Tensor>& mins,
                int64_t G);
void check(const torch::Tensor& codes, const torch::Tensor& scales, const c10::optional<torch::Tensor>& mins,
           int64_t K, int64_t G, bool q4);

// AMX (amx_linear.cpp): whether this CPU and OS run tile instructions; y = x W^T for bf16 x.
bool amx_available();
torch::Tensor amx_linear(const torch::Tensor& x, const Packed& w, bool q4);

// VNNI (vnni_gemv.cpp): whether quant_linear_vnni was built for this CPU.
bool vnni_available();

}  // namespace ferry_quant
