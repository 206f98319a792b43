// Shared by the quantized-matmul sources: the packed weight layout and how to read it.
#pragma once
#include <torch/extension.h>
#include <cstring>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
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

// Scale (or min) of groups [g0, g0 + n) of row `row` as fp32, into `dst` (n <= 16).
inline void stage(const void* base, bool f16, int64_t row, int64_t groups, int64_t g0, int64_t n, float* dst) {
#if defined(__AVX512F__)
  const __mmask16 k = static_cast<__mmask16>((1u << n) - 1);
  const int64_t at = row * groups + g0;
  _mm512_storeu_ps(dst, f16 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, static_cast<const at::Half*>(base) + at))
                            : _mm512_maskz_loadu_ps(k, static_cast<const float*>(base) + at));
#else
  if (f16) {
    const at::Half* p = static_cast<const at::Half*>(base) + row * groups + g0;
    for (int64_t i = 0; i < n; ++i) dst[i] = to_f(p[i]);
  } else {
    std::memcpy(dst, static_cast<const float*>(base) + row * groups + g0, n * sizeof(float));
  }
#endif
}

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
