// The 512-bit int8-activation tiles (AVX512-VNNI vpdpbusd): output rows x a few activation rows.
#pragma once
#include "int8_acts.h"

#ifdef FERRY_VNNI
namespace ferry_quant::zmm {

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
// stack, and every FMA waited on a store-to-load round trip: 4x slower); PER_LANE (G <= 32) too, so
// the loop has no branch on it.
template <bool Q4, bool PER_LANE, int NB, int MB>
void tile(const Packed& w, const Acts& a, int64_t n0, float* out /* [MB, 16] */) {
  // Each lane's weight scale, one vector per output row and pair, shared by the activation rows: groups of
  // 32 (or 16, q8 only: lane l of pair p is in group 4 p + l / 4; PER_LANE) pick theirs from 16 staged
  // groups; a larger group (64 k elements: k whole pairs) has one for all lanes. (Summing a large group's
  // lanes first and scaling once took as many registers again for the partial sums.)
  const int64_t gpp = w.G == 16 ? 4 : 2, pairs_per_stage = 16 / gpp;  // PER_LANE: groups per pair, per stage
  const int64_t pairs_per_group = w.G / 64;                             // otherwise
  const __m512i glanes = w.G == 16 ? _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                                                                         13, 14, 15), 2) : lane_blocks(Q4);
  __m512 acc[NB][MB];
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < MB; ++m) acc[j][m] = _mm512_setzero_ps();
  const uint8_t* rows[NB];
  for (int j = 0; j < NB; ++j) rows[j] = w.codes + (n0 + j) * w.row_bytes;
  alignas(64) float sc[NB][16];
  __m512 ws[NB];
  int64_t group = 0, left = 0;  // G >= 64: the current group, pairs left in it
  for (int64_t p = 0; p < a.pairs; ++p) {
    const bool tail = 2 * p + 1 >= a.blocks;
    if constexpr (PER_LANE) {
      const int64_t q = p & (pairs_per_stage - 1);  // 8 or 4 pairs per stage
      if (q == 0) {
        const int64_t gn = std::min<int64_t>(16, w.groups - gpp * p);
        for (int j = 0; j < NB; ++j) stage(w.scales, w.f16, n0 + j, w.groups, gpp * p, gn, sc[j]);
      }
      const __m512i idx = _mm512_add_epi32(glanes, _mm512_set1_epi32(static_cast<int>(gpp * q)));
      for (int j = 0; j < NB; ++j) ws[j] = _mm512_permutexvar_ps(idx, _mm512_load_ps(sc[j]));
    } else if (left-- == 0) {
      for (int j = 0; j < NB; ++j) {
        const int64_t off = (n0 + j) * w.groups + group;
        ws[j] = _mm512_set1_ps(w.f16 ? to_f(static_cast<const at::Half*>(w.scales)[off])
                                     : static_cast<const float*>(w.scales)[off]);
      }
      ++group, left = pairs_per_group - 1;
    }
    __m512i wv[NB];
    for (int j = 0; j < NB; ++j) {
      if (p % 4 == 0) _mm_prefetch(reinterpret_cast<const char*>(rows[j] + (Q4 ? 32 : 64) * p) + 2048, _MM_HINT_T0);
      wv[j] = Q4 ? load_pair_q4(rows[j], p, tail) : load_pair_q8(rows[j], p, tail);
    }
    for (int m = 0; m < MB; ++m) {
      const __m512i xq = _mm512_loadu_si512(a.xq + (m * a.pairs + p) * 64);
      const __m512 dx = _mm512_loadu_ps(a.dx + (m * a.pairs + p) * 16);
      for (int j = 0; j < NB; ++j) {
        const __m512i dp = Q4 ? _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[j], xq)
                              : dot_q8(_mm512_setzero_si512(), wv[j], xq);
        acc[j][m] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dp), dx), ws[j], acc[j][m]);
      }
    }
  }
  if (w.mins)  // the min term, 16 groups per FMA into the same lanes (masked: nothing read past a row)
    for (int64_t g0 = 0; g0 < w.groups; g0 += 16) {
      const __mmask16 k = static_cast<__mmask16>((1u << std::min<int64_t>(16, w.groups - g0)) - 1);
      for (int j = 0; j < NB; ++j) {
        const int64_t off = (n0 + j) * w.groups + g0;
        const __m512 mv = w.f16
            ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, static_cast<const at::Half*>(w.mins) + off))
            : _mm512_maskz_loadu_ps(k, static_cast<const float*>(w.mins) + off);
        for (int m = 0; m < MB; ++m)
          acc[j][m] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(k, a.gsum + m * a.groups + g0), acc[j][m]);
      }
    }
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < MB; ++m) out[m * 16 + j] = _mm512_reduce_add_ps(acc[j][m]);
}

template <bool Q4, bool PER_LANE>
struct Tiles {  // this file's tiles, as tile_m (int8_acts.h) runs them
  template <int NB, int MB>
  static void run(const Packed& w, const Acts& a, int64_t n0, float* out) { tile<Q4, PER_LANE, NB, MB>(w, a, n0, out); }
};

template <bool Q4, int NB>
void tile_rows(const Packed& w, const Acts& a, int64_t n0, float* out) {
  if (w.G <= 32) tile_m<Tiles<Q4, true>, NB>(w, a, n0, out);
  else tile_m<Tiles<Q4, false>, NB>(w, a, n0, out);
}

}  // namespace ferry_quant::zmm
#endif
