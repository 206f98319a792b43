// x quantized to int8 per 32-element block for the int8-activation tiles (int8_ymm.h, int8_zmm.h): the
// codes, their scales and sums, and the view of a few rows that one tile multiplies. See vnni_gemv.cpp.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "packed.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define FERRY_VNNI 1      // vpdpbusd on 512-bit registers (int8_zmm.h)
#endif
#if defined(FERRY_YMM)
#define FERRY_INT8_YMM 1  // 256-bit tiles (int8_ymm.h): AVX2 maddubs; in the VNNI build too, for CPUs that split 512-bit ops
#endif
#if defined(FERRY_VNNI) || defined(FERRY_INT8_YMM)
#define FERRY_INT8 1

namespace ferry_quant {

// x quantized per 32-element block, arranged pair by pair (64 codes per pair of blocks) in the order the
// weight codes of that pair are unpacked (one 512-bit register, or two 256-bit ones):
//   q4: [b0 e0-15 | b1 e0-15 | b0 e16-31 | b1 e16-31]  (low nibbles of the pair's 32 bytes, then high)
//   q8: [b0 e0-31 | b1 e0-31]                          (codes in natural order)
// dx: the blocks' scales (for the 512-bit tiles: per pair spread over the 16 lanes in which its dot
// products come out, a memory operand of one multiply); gsum: sums of the rounded x per weight group (for the
// min term).
struct QuantizedActs {
  int64_t M, K, blocks, pairs, groups;
  std::vector<int8_t> xq;  // [M, pairs * 64]
  std::vector<float> dx;   // [M, pairs * 2] (a missing last block: 0); lanes16: [M, pairs * 16]
  bool lanes16;            // dx spread over the 16 lanes of the 512-bit tiles (int8_zmm.h)
  std::vector<float> gsum; // [M, groups]
};

// x[0, 32) to int8 codes (elements 0-15 into lo, 16-31 into hi) and the code sums of the two halves;
// returns amax. Both ISAs round x * (127 / amax) to nearest even (cvtps under the default MXCSR), so
// they multiply the same activations; |codes| <= 127, so packing to int8 is exact.
#ifdef FERRY_VNNI
inline float quantize_block(const float* x, int8_t* lo, int8_t* hi, int32_t* sums) {
  const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
  const float amax = std::max(_mm512_reduce_max_ps(_mm512_abs_ps(v0)), _mm512_reduce_max_ps(_mm512_abs_ps(v1)));
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm512_cvtsepi32_epi8(i0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), _mm512_cvtsepi32_epi8(i1));
  sums[0] = _mm512_reduce_add_epi32(i0), sums[1] = _mm512_reduce_add_epi32(i1);
  return amax;
}
#else
inline float quantize_block(const float* x, int8_t* lo, int8_t* hi, int32_t* sums) {
  __m256 v[4], mx = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    mx = _mm256_max_ps(mx, _mm256_andnot_ps(_mm256_set1_ps(-0.f), v[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
  // the packs interleave 128-bit lanes; the permute restores element order (llama.cpp's quantize_row_q8_0)
  const __m256i packed = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm256_castsi256_si128(packed));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), _mm256_extracti128_si256(packed, 1));
  for (int h = 0; h < 2; ++h) {
    const __m256i s = _mm256_add_epi32(q[2 * h], q[2 * h + 1]);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    sums[h] = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
  }
  return amax;
}
#endif

inline QuantizedActs quantize_acts(const float* x, int64_t M, int64_t K, int64_t G, bool q4, bool lanes16) {
  QuantizedActs a;
  a.lanes16 = lanes16;
  a.M = M, a.K = K, a.blocks = K / 32, a.pairs = (K / 32 + 1) / 2, a.groups = K / G;
  a.xq.assign(M * a.pairs * 64, 0);
  a.dx.assign(lanes16 ? M * a.pairs * 16 : M * a.pairs * 2 + 8, 0.f);  // + 8: the 256-bit tiles read 8 at a time
  a.gsum.assign(M * a.groups, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < a.blocks; ++b) {
      const int64_t p = b / 2, half = b % 2;
      int8_t* dst = a.xq.data() + (m * a.pairs + p) * 64;
      int32_t s[2];
      const float amax = q4 ? quantize_block(x + m * K + 32 * b, dst + 16 * half, dst + 32 + 16 * half, s)
                            : quantize_block(x + m * K + 32 * b, dst + 32 * half, dst + 32 * half + 16, s);
      const float d = amax / 127.f;
      if (lanes16) {  // lanes of block `half`: q4 [b0 x4, b1 x4, b0 x4, b1 x4], q8 [b0 x8, b1 x8] (lane_blocks)
        float* dl = a.dx.data() + (m * a.pairs + p) * 16;
        for (int l = 0; l < 16; ++l)
          if ((q4 ? (l / 4) % 2 : l / 8) == half) dl[l] = d;
      } else {
        a.dx[(m * a.pairs + p) * 2 + half] = d;
      }
      float* gs = a.gsum.data() + m * a.groups;
      if (G == 16) {
        gs[2 * b] += d * static_cast<float>(s[0]);
        gs[2 * b + 1] += d * static_cast<float>(s[1]);
      } else {
        gs[(32 * b) / G] += d * static_cast<float>(s[0] + s[1]);
      }
    }
  return a;
}

// Up to MAX_ROWS consecutive rows of a QuantizedActs (rows m0..m0+M-1): what one tile multiplies.
struct Acts {
  int64_t M, K, blocks, pairs, groups;
  const int8_t* xq;
  const float* dx;
  const float* gsum;
};

inline Acts rows_of(const QuantizedActs& q, int64_t m0, int64_t M) {
  const int64_t dx_row = q.lanes16 ? q.pairs * 16 : q.pairs * 2;
  return {M, q.K, q.blocks, q.pairs, q.groups, q.xq.data() + m0 * q.pairs * 64, q.dx.data() + m0 * dx_row,
          q.gsum.data() + m0 * q.groups};
}

// Runs Tiles::run<NB, MB> for a chunk of a.M (1..8) activation rows, MB a template argument so the
// accumulators stay in registers (with a runtime row count they went to the stack: 4x slower). At most
// 8 accumulators: 3 or 4 rows take output rows 2 at a time, 5..8 one at a time (each weight step is still
// loaded and unpacked once for all rows). With 16 of AVX-512's 32 registers GCC kept some on the stack,
// and 8 rows ran 1.3x slower.
template <class Tiles, int NB, int MB>
inline void tile_fit(const Packed& w, const Acts& a, int64_t n0, float* out) {
  if constexpr (NB * MB > 8) {
    tile_fit<Tiles, NB / 2, MB>(w, a, n0, out);
    tile_fit<Tiles, NB / 2, MB>(w, a, n0 + NB / 2, out + NB / 2);
  } else {
    Tiles::template run<NB, MB>(w, a, n0, out);
  }
}

template <class Tiles, int NB>
inline void tile_m(const Packed& w, const Acts& a, int64_t n0, float* out) {
  switch (a.M) {
    case 1: tile_fit<Tiles, NB, 1>(w, a, n0, out); break;
    case 2: tile_fit<Tiles, NB, 2>(w, a, n0, out); break;
    case 3: tile_fit<Tiles, NB, 3>(w, a, n0, out); break;
    case 4: tile_fit<Tiles, NB, 4>(w, a, n0, out); break;
    case 5: tile_fit<Tiles, NB, 5>(w, a, n0, out); break;
    case 6: tile_fit<Tiles, NB, 6>(w, a, n0, out); break;
    case 7: tile_fit<Tiles, NB, 7>(w, a, n0, out); break;
    default: tile_fit<Tiles, NB, 8>(w, a, n0, out); break;
  }
}

}  // namespace ferry_quant
#endif
