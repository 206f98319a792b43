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
#include <algorithm>
#include <cmath>
#include <vector>

#include "neon_gemv.h"
#include "packed.h"

namespace ferry_quant {

// Activation rows per tile (a decode step of a few sequences, or the verify step of a speculative draft
// of up to 7 tokens): each weight code is loaded and unpacked once for all of them. A call with more rows
// runs them in chunks of this many against the same weight tile.
constexpr int64_t MAX_ROWS = 8;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define FERRY_VNNI 1      // vpdpbusd on 512-bit registers
#elif defined(FERRY_YMM)
#define FERRY_INT8_YMM 1  // vpmaddubsw + vpmaddwd on 256-bit ones (AVX2; AVX-512 without VNNI)
#endif
#if defined(FERRY_VNNI) || defined(FERRY_INT8_YMM)
#define FERRY_INT8 1

namespace {

// x quantized per 32-element block, arranged pair by pair (64 codes per pair of blocks) in the order the
// weight codes of that pair are unpacked (one 512-bit register, or two 256-bit ones):
//   q4: [b0 e0-15 | b1 e0-15 | b0 e16-31 | b1 e16-31]  (low nibbles of the pair's 32 bytes, then high)
//   q8: [b0 e0-31 | b1 e0-31]                          (codes in natural order)
// dx: the blocks' scales (AVX512-VNNI: per pair spread over the 16 lanes in which its dot products
// come out, a memory operand of one multiply); gsum: sums of the rounded x per weight group (for the
// min term).
struct QuantizedActs {
  int64_t M, K, blocks, pairs, groups;
  std::vector<int8_t> xq;  // [M, pairs * 64]
  std::vector<float> dx;   // [M, pairs * 2] (a missing last block: 0); VNNI: [M, pairs * 16]
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

QuantizedActs quantize_acts(const float* x, int64_t M, int64_t K, int64_t G, bool q4) {
  QuantizedActs a;
  a.M = M, a.K = K, a.blocks = K / 32, a.pairs = (K / 32 + 1) / 2, a.groups = K / G;
  a.xq.assign(M * a.pairs * 64, 0);
#ifdef FERRY_VNNI
  a.dx.assign(M * a.pairs * 16, 0.f);
#else
  a.dx.assign(M * a.pairs * 2 + 8, 0.f);  // + 8: the AVX2 tiles read 8 at a time
#endif
  a.gsum.assign(M * a.groups, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < a.blocks; ++b) {
      const int64_t p = b / 2, half = b % 2;
      int8_t* dst = a.xq.data() + (m * a.pairs + p) * 64;
      int32_t s[2];
      const float amax = q4 ? quantize_block(x + m * K + 32 * b, dst + 16 * half, dst + 32 + 16 * half, s)
                            : quantize_block(x + m * K + 32 * b, dst + 32 * half, dst + 32 * half + 16, s);
      const float d = amax / 127.f;
#ifdef FERRY_VNNI  // lanes of block `half`: q4 [b0 x4, b1 x4, b0 x4, b1 x4], q8 [b0 x8, b1 x8] (lane_blocks)
      float* dl = a.dx.data() + (m * a.pairs + p) * 16;
      for (int l = 0; l < 16; ++l)
        if ((q4 ? (l / 4) % 2 : l / 8) == half) dl[l] = d;
#else
      a.dx[(m * a.pairs + p) * 2 + half] = d;
#endif
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

Acts rows_of(const QuantizedActs& q, int64_t m0, int64_t M) {
#ifdef FERRY_VNNI
  const int64_t dx_row = q.pairs * 16;
#else
  const int64_t dx_row = q.pairs * 2;
#endif
  return {M, q.K, q.blocks, q.pairs, q.groups, q.xq.data() + m0 * q.pairs * 64, q.dx.data() + m0 * dx_row,
          q.gsum.data() + m0 * q.groups};
}

#ifdef FERRY_VNNI
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

// At most 8 accumulators, as on AVX2: 3 or 4 activation rows take output rows 2 at a time, 5..8 one at a
// time (each weight pair is still loaded and unpacked once for all rows). With 16 (of 32 registers) GCC
// kept some on the stack, and 8 rows ran 1.3x slower.
template <bool Q4, bool PER_LANE, int NB, int MB>
void tile_fit(const Packed& w, const Acts& a, int64_t n0, float* out) {
  if constexpr (NB * MB > 8) {
    tile_fit<Q4, PER_LANE, NB / 2, MB>(w, a, n0, out);
    tile_fit<Q4, PER_LANE, NB / 2, MB>(w, a, n0 + NB / 2, out + NB / 2);
  } else {
    tile<Q4, PER_LANE, NB, MB>(w, a, n0, out);
  }
}

template <bool Q4, bool PER_LANE, int NB>
void tile_m(const Packed& w, const Acts& a, int64_t n0, float* out) {
  switch (a.M) {
    case 1: tile_fit<Q4, PER_LANE, NB, 1>(w, a, n0, out); break;
    case 2: tile_fit<Q4, PER_LANE, NB, 2>(w, a, n0, out); break;
    case 3: tile_fit<Q4, PER_LANE, NB, 3>(w, a, n0, out); break;
    case 4: tile_fit<Q4, PER_LANE, NB, 4>(w, a, n0, out); break;
    case 5: tile_fit<Q4, PER_LANE, NB, 5>(w, a, n0, out); break;
    case 6: tile_fit<Q4, PER_LANE, NB, 6>(w, a, n0, out); break;
    case 7: tile_fit<Q4, PER_LANE, NB, 7>(w, a, n0, out); break;
    default: tile_fit<Q4, PER_LANE, NB, 8>(w, a, n0, out); break;
  }
}

template <bool Q4, int NB>
void tile_rows(const Packed& w, const Acts& a, int64_t n0, float* out) {
  if (w.G <= 32) tile_m<Q4, true, NB>(w, a, n0, out);
  else tile_m<Q4, false, NB>(w, a, n0, out);
}
#else
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

// Output rows n0..n0+NB-1 for activation rows 0..MB-1 (llama.cpp's ggml_vec_dot_q4_1_q8_1 / q8_0_q8_0
// arithmetic): each step's int32 lanes, as fp32, times their unit's scale product, one FMA per step.
template <bool Q4, bool G16, int NB, int MB>
void tile(const Packed& w, const Acts& a, int64_t n0, float* out /* [MB, 16] */) {
  constexpr int64_t UPS = (Q4 || G16) ? 2 : 1;  // units per step
  const int64_t units = (Q4 ? a.pairs : a.blocks) * UPS;
  const __m256i halves = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  __m256 acc[NB][MB];
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < MB; ++m) acc[j][m] = _mm256_setzero_ps();
  alignas(32) float d[NB][MB][CHUNK];
  for (int64_t u0 = 0; u0 < units; u0 += CHUNK) {
    const int64_t u1 = std::min(units, u0 + CHUNK);
    unit_products<NB, MB, G16 ? 2 : 1>(w, a, n0, u0, u1, d);
    for (int64_t s = u0 / UPS; s < u1 / UPS; ++s) {
      const int64_t c = s * UPS - u0;  // the step's first unit in the chunk
      const __m256i idx = _mm256_add_epi32(halves, _mm256_set1_epi32(static_cast<int>(c & 7)));
      for (int j = 0; j < NB; ++j) {
        const uint8_t* p = w.codes + (n0 + j) * w.row_bytes + 32 * s;
        if (s % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(p) + 2048, _MM_HINT_T0);
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
  if (w.mins)  // the min term, 8 groups per FMA into the same lanes (load8: nothing read past a row)
    for (int64_t g0 = 0; g0 < w.groups; g0 += 8) {
      const int64_t c = std::min<int64_t>(8, w.groups - g0);
      for (int j = 0; j < NB; ++j) {
        const __m256 mv = load8(static_cast<const char*>(w.mins) + ((n0 + j) * w.groups + g0) * (w.f16 ? 2 : 4),
                                w.f16, c);
        for (int m = 0; m < MB; ++m)
          acc[j][m] = _mm256_fmadd_ps(mv, load8(a.gsum + m * a.groups + g0, false, c), acc[j][m]);
      }
    }
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < MB; ++m) out[m * 16 + j] = hsum(acc[j][m]);
}

// At most 8 accumulators (AVX2 has 16 registers): 3 or 4 activation rows take output rows 2 at a time,
// 5..8 one at a time (each weight step is still loaded and unpacked once for all rows).
template <bool Q4, bool G16, int NB, int MB>
void tile_fit(const Packed& w, const Acts& a, int64_t n0, float* out) {
  if constexpr (NB * MB > 8) {
    tile_fit<Q4, G16, NB / 2, MB>(w, a, n0, out);
    tile_fit<Q4, G16, NB / 2, MB>(w, a, n0 + NB / 2, out + NB / 2);
  } else {
    tile<Q4, G16, NB, MB>(w, a, n0, out);
  }
}

template <bool Q4, bool G16, int NB>
void tile_m(const Packed& w, const Acts& a, int64_t n0, float* out) {
  switch (a.M) {
    case 1: tile_fit<Q4, G16, NB, 1>(w, a, n0, out); break;
    case 2: tile_fit<Q4, G16, NB, 2>(w, a, n0, out); break;
    case 3: tile_fit<Q4, G16, NB, 3>(w, a, n0, out); break;
    case 4: tile_fit<Q4, G16, NB, 4>(w, a, n0, out); break;
    case 5: tile_fit<Q4, G16, NB, 5>(w, a, n0, out); break;
    case 6: tile_fit<Q4, G16, NB, 6>(w, a, n0, out); break;
    case 7: tile_fit<Q4, G16, NB, 7>(w, a, n0, out); break;
    default: tile_fit<Q4, G16, NB, 8>(w, a, n0, out); break;
  }
}

template <bool Q4, int NB>
void tile_rows(const Packed& w, const Acts& a, int64_t n0, float* out) {
  if (!Q4 && w.G == 16) tile_m<false, true, NB>(w, a, n0, out);  // q4 has no 16-element groups
  else tile_m<Q4, false, NB>(w, a, n0, out);
}
#endif

}  // namespace
#endif

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
  const torch::Tensor xc = x.contiguous();
  std::vector<float> xf(M * K), yf(M * N);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quant_linear_neon_x", [&] {
    const scalar_t* src = xc.data_ptr<scalar_t>();
    for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(src[i]);
  });
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
        // every chunk of up to MAX_ROWS activation rows against this tile's weight rows (still in L1)
        for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
          const Acts rows = rows_of(a, m0, std::min(MAX_ROWS, M - m0));
          int64_t n = lo;
          for (; n + 4 <= hi; n += 4) {
            if (q4) tile_rows<true, 4>(w, rows, n, buf + (n - lo) % 16);
            else tile_rows<false, 4>(w, rows, n, buf + (n - lo) % 16);
          }
          for (; n < hi; ++n) {
            if (q4) tile_rows<true, 1>(w, rows, n, buf + (n - lo) % 16);
            else tile_rows<false, 1>(w, rows, n, buf + (n - lo) % 16);
          }
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
