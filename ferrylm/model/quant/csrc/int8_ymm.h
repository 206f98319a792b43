// The 256-bit int8-activation tiles (AVX2 vpmaddubsw + vpmaddwd, llama.cpp's arithmetic): output rows x a
// few activation rows.
#pragma once
#include "int8_acts.h"

#ifdef FERRY_INT8_YMM
namespace ferry_quant::ymm {

// How far ahead of a tile's loads to prefetch: the same bytes of the rows NB, 2 NB, ... further on (a
// tile reads its NB rows side by side, so a fixed byte distance under NB row lengths re-fetched rows the
// tile was already reading and left every other next row to a demand miss), at least PREFETCH_MIN
// bytes ahead. Measured on an MoE GGUF's 1-row decode (Q8_0, 1 KB rows, AVX2, 2026-12-04): 16.2 vs
// 17.7 ms a token (medians of 5, noisy host) against a fixed 2 KB.
constexpr int64_t PREFETCH_MIN = 2048;

inline int64_t prefetch_ahead(int64_t nb, int64_t row_bytes) {
  const int64_t tile_bytes = nb * row_bytes;
  return tile_bytes * std::max<int64_t>(1, (PREFETCH_MIN + tile_bytes - 1) / tile_bytes);
}

// The weight scale of each unit u in [u0, u1) of row n into ws[u - u0] (room for u1 - u0 + 16: stage()
// may store 16); a unit is 32 elements (16 with 16-element groups), upg units to a group.
inline void unit_scales(const Packed& w, int64_t n, int64_t upg, int64_t u0, int64_t u1, float* ws) {
  if (upg == 1) {  // one group per unit: the staged scales as they are
    for (int64_t u = u0; u < u1; u += 16)
      stage(w.scales, w.f16, n, w.groups, u, std::min<int64_t>(16, u1 - u), ws + (u - u0));
    return;
  }
  alignas(64) float sc[16];
  for (int64_t g = u0 / upg; g * upg < u1; g += 16) {
    const int64_t gn = std::min<int64_t>(16, w.groups - g);
    stage(w.scales, w.f16, n, w.groups, g, gn, sc);
    for (int64_t i = 0; i < gn && (g + i) * upg < u1; ++i)
      std::fill(ws + std::max(u0, (g + i) * upg) - u0, ws + std::min(u1, (g + i + 1) * upg) - u0, sc[i]);
  }
}

// A step is 32 bytes of a weight row: q4, the pair of blocks at p (the low nibbles meet the pair's first
// 32 x codes, the high nibbles the next 32); q8, one block, kept with its absolute value for the sign trick.
struct Step {
  __m256i a, b;
};

template <bool Q4>
inline Step load_step(const uint8_t* p, bool tail) {
  if constexpr (Q4) {  // a pair past the row's last block (odd block count) has only its first 16 bytes
    const __m128i* half = reinterpret_cast<const __m128i*>(p);
    const __m256i raw = tail ? _mm256_set_m128i(_mm_setzero_si128(), _mm_loadu_si128(half))
                             : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i low = _mm256_set1_epi8(0x0F);
    return {_mm256_and_si256(raw, low), _mm256_and_si256(_mm256_srli_epi16(raw, 4), low)};
  }
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm256_sign_epi8(w, w), w};
}

// The step's products with x codes xq as 8 int32 lanes, lanes 0-3 from the step's first unit, 4-7 from
// its second (q4: block b0 / b1; q8: elements 0-15 / 16-31). vpmaddubsw takes unsigned weights: q4 codes
// 0..15, summed over both nibbles in int16 (at most 4 * 15 * 127 = 7620); q8 as |w| times x carrying w's
// sign (|-128| read unsigned is 128; a pair reaches 2 * 128 * 127 = 32512, short of saturating).
template <bool Q4>
inline __m256i dot_step(const Step& s, const int8_t* xq) {
  const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq)), ones = _mm256_set1_epi16(1);
  if constexpr (Q4) {
    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32));
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(s.a, x0), _mm256_maddubs_epi16(s.b, x1)), ones);
  }
  return _mm256_madd_epi16(_mm256_maddubs_epi16(s.a, _mm256_sign_epi8(x0, s.b)), ones);
}

constexpr int64_t CHUNK = 128;  // units whose scale products are made at a time (on the stack, in L1)

// d[j][m][u - u0] = the weight scale of unit u of row n0 + j times x's block scale of activation row m,
// for u in [u0, u1); a unit is a block, or half of one with 16-element groups (UPB = 2 units per block).
template <int NB, int MB, int UPB>
void unit_products(const Packed& w, const Acts& a, int64_t n0, int64_t u0, int64_t u1,
                   float (*d)[MB][CHUNK]) {
  const int64_t real = a.blocks * UPB, upg = UPB == 2 ? 1 : w.G / 32;
  const __m256i dup = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
  alignas(32) float ws[CHUNK + 16];
  for (int j = 0; j < NB; ++j) {
    unit_scales(w, n0 + j, upg, u0, std::min(u1, real), ws);
    // the missing block of an odd pair: its codes are zero, but stack garbage times zero may be NaN
    for (int64_t u = std::max(u0, real); u < u1; ++u) ws[u - u0] = 0.f;
    for (int m = 0; m < MB; ++m) {  // 8 at a time; dx has 8 floats of padding past its end
      const float* dx = a.dx + m * a.pairs * 2 + u0 / UPB;
      for (int64_t u = 0; u < u1 - u0; u += 8) {
        const __m256 dxv = UPB == 1 ? _mm256_loadu_ps(dx + u)
                                    : _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(dx + u / 2)), dup);
        _mm256_store_ps(&d[j][m][u], _mm256_mul_ps(_mm256_load_ps(ws + u), dxv));
      }
    }
  }
}

// The weight scales of blocks b and b + 1 of a row (scales of the row at `row`) in lanes 0 and 1 (ONE:
// only block b exists; lane 1 is 0).
template <bool F16, bool ONE>
inline __m128 block_scales(const void* row, int64_t b) {
  if constexpr (F16) {
    const uint16_t* h = static_cast<const uint16_t*>(row) + b;
    uint32_t bits = h[0];
    if constexpr (!ONE) bits |= uint32_t{h[1]} << 16;
    return _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(bits)));
  } else {
    const float* f = static_cast<const float*>(row) + b;
    if constexpr (ONE) return _mm_load_ss(f);
    return _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(f)));
  }
}

// The min term of rows n0..n0+NB-1 (sum over groups of min * sum of the rounded x), 8 groups per FMA.
template <int NB, int MB>
inline void add_min_term(const Packed& w, const Acts& a, int64_t n0, __m256 (&acc)[NB][MB]) {
  for (int64_t g0 = 0; g0 < w.groups; g0 += 8) {
    const int64_t c = std::min<int64_t>(8, w.groups - g0);
    for (int j = 0; j < NB; ++j) {
      const __m256 mv = load8(static_cast<const char*>(w.mins) + ((n0 + j) * w.groups + g0) * (w.f16 ? 2 : 4),
                              w.f16, c);
      for (int m = 0; m < MB; ++m) acc[j][m] = _mm256_fmadd_ps(mv, load8(a.gsum + m * a.groups + g0, false, c), acc[j][m]);
    }
  }
}

// Groups of 32 (Q4_0, Q4_1, Q8_0, int4-g32: the default model's formats): the scale products are made in
// the step itself, from the step's two (q4) or one (q8) weight scales and x's, with no table: at one
// activation row the table (unit_products) took a third of the time (perf, SmolLM2 shapes). The scale
// format (F16) and the last pair of an odd block count (TAIL) are template arguments: branches on them
// in the step, and the row pointers recomputed there, cost a fifth of a 1-row call (perf annotate).
template <bool Q4, bool F16, bool TAIL, int NB, int MB>
inline void step_g32(const uint8_t* const (&codes)[NB], const char* const (&scales)[NB], const Acts& a, int64_t s,
                     __m256 (&acc)[NB][MB], int64_t ahead) {
  const __m256i halves = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  for (int j = 0; j < NB; ++j) {
    const uint8_t* p = codes[j] + 32 * s;
    if (s % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(p) + ahead, _MM_HINT_T0);
    const Step st = load_step<Q4>(p, TAIL);
    const __m128 ws = block_scales<F16, !Q4 || TAIL>(scales[j], Q4 ? 2 * s : s);
    for (int m = 0; m < MB; ++m) {
      const float* dx = a.dx + m * a.pairs * 2 + (Q4 ? 2 * s : s);  // x's scales of the step's blocks
      const __m256 sv = Q4 ? _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_mul_ps(
                                 ws, _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(dx))))), halves)
                           : _mm256_set1_ps(_mm_cvtss_f32(ws) * dx[0]);
      const __m256i dp = dot_step<Q4>(st, a.xq + m * a.pairs * 64 + (Q4 ? 64 : 32) * s);
      acc[j][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dp), sv, acc[j][m]);
    }
  }
}

template <bool Q4, bool F16, int NB, int MB>
void tile_g32(const Packed& w, const Acts& a, int64_t n0, float* out /* [MB, 16] */) {
  const int64_t full = Q4 ? a.blocks / 2 : a.blocks;  // steps with every block present
  const uint8_t* codes[NB];
  const char* scales[NB];
  for (int j = 0; j < NB; ++j) {
    codes[j] = w.codes + (n0 + j) * w.row_bytes;
    scales[j] = static_cast<const char*>(w.scales) + (n0 + j) * w.groups * (F16 ? 2 : 4);
  }
  __m256 acc[NB][MB];
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < MB; ++m) acc[j][m] = _mm256_setzero_ps();
  const int64_t ahead = prefetch_ahead(NB, w.row_bytes);
  for (int64_t s = 0; s < full; ++s) step_g32<Q4, F16, false, NB, MB>(codes, scales, a, s, acc, ahead);
  if (Q4 && a.blocks % 2) step_g32<Q4, F16, true, NB, MB>(codes, scales, a, full, acc, ahead);
  if (w.mins) add_min_term<NB, MB>(w, a, n0, acc);
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < MB; ++m) out[m * 16 + j] = hsum(acc[j][m]);
}

// Output rows n0..n0+NB-1 for activation rows 0..MB-1 (llama.cpp's ggml_vec_dot_q4_1_q8_1 / q8_0_q8_0
// arithmetic): each step's int32 lanes, as fp32, times their unit's scale product, one FMA per step.
template <bool Q4, bool G16, int NB, int MB>
void tile(const Packed& w, const Acts& a, int64_t n0, float* out /* [MB, 16] */) {
  if constexpr (!G16) {
    if (w.G == 32) return w.f16 ? tile_g32<Q4, true, NB, MB>(w, a, n0, out) : tile_g32<Q4, false, NB, MB>(w, a, n0, out);
  }
  constexpr int64_t UPS = (Q4 || G16) ? 2 : 1;  // units per step
  const int64_t units = (Q4 ? a.pairs : a.blocks) * UPS;
  const __m256i halves = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  __m256 acc[NB][MB];
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < MB; ++m) acc[j][m] = _mm256_setzero_ps();
  alignas(32) float d[NB][MB][CHUNK];
  const int64_t ahead = prefetch_ahead(NB, w.row_bytes);
  for (int64_t u0 = 0; u0 < units; u0 += CHUNK) {
    const int64_t u1 = std::min(units, u0 + CHUNK);
    unit_products<NB, MB, G16 ? 2 : 1>(w, a, n0, u0, u1, d);
    for (int64_t s = u0 / UPS; s < u1 / UPS; ++s) {
      const int64_t c = s * UPS - u0;  // the step's first unit in the chunk
      const __m256i idx = _mm256_add_epi32(halves, _mm256_set1_epi32(static_cast<int>(c & 7)));
      for (int j = 0; j < NB; ++j) {
        const uint8_t* p = w.codes + (n0 + j) * w.row_bytes + 32 * s;
        if (s % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(p) + ahead, _MM_HINT_T0);
        const Step st = load_step<Q4>(p, Q4 && 2 * s + 1 >= a.blocks);
        for (int m = 0; m < MB; ++m) {
          const __m256 sv = UPS == 1 ? _mm256_broadcast_ss(&d[j][m][c])
                                     : _mm256_permutevar8x32_ps(_mm256_load_ps(&d[j][m][c & ~7]), idx);
          const __m256i dp = dot_step<Q4>(st, a.xq + m * a.pairs * 64 + (Q4 ? 64 : 32) * s);
          acc[j][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dp), sv, acc[j][m]);
        }
      }
    }
  }
  if (w.mins) add_min_term<NB, MB>(w, a, n0, acc);  // load8: nothing read past a row
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < MB; ++m) out[m * 16 + j] = hsum(acc[j][m]);
}

template <bool Q4, bool G16>
struct Tiles {  // this file's tiles, as tile_m (int8_acts.h) runs them
  template <int NB, int MB>
  static void run(const Packed& w, const Acts& a, int64_t n0, float* out) { tile<Q4, G16, NB, MB>(w, a, n0, out); }
};

template <bool Q4, int NB>
void tile_rows(const Packed& w, const Acts& a, int64_t n0, float* out) {
  if (!Q4 && w.G == 16) tile_m<Tiles<false, true>, NB>(w, a, n0, out);  // q4 has no 16-element groups
  else tile_m<Tiles<Q4, false>, NB>(w, a, n0, out);
}

}  // namespace ferry_quant::ymm
#endif
