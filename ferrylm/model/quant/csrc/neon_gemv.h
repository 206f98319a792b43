// The ARM NEON twin of vnni_gemv.cpp: decode-sized matmuls (at most 4 activation rows) over packed
// q4 / q8 weights (packed.h's layout) with activations quantized to int8 per 32-element block.
//
// Torch-free (raw pointers, std::vector) so it is tested without an aarch64 torch, under qemu
// (tests/csrc/neon_kernels_test.cpp); vnni_gemv.cpp is the glue that calls it from the torch op.
// Everything here exists only where NEON may be used (`FERRY_NEON_GEMV` is then defined); elsewhere,
// and in the portable build, the header is empty.
//
// Arithmetic, as vnni_gemv.cpp (llama.cpp's Q8_0 / Q8_1 activations): each block of x gets the scale
// d = amax / 127 and codes round(x * 127 / amax) to nearest even (FCVTNS, as x86's cvtps under the
// default MXCSR), so both ISAs multiply the same rounded activations. A block's weight codes times its x
// codes are summed in int32 lanes (SDOT with the dot-product extension, else SMULL + SADALP), converted
// once and scaled by weight scale * d; the min term uses per-group sums of the rounded x, so the result
// is the dequantized weights times the rounded x, up to fp32 summation order.
//
// Layout read: q4, 16 bytes per 32 elements, low nibble = element i, high nibble = element i + 16; q8,
// int8 in natural order; one scale (and optional min) per group of G elements, fp32 or fp16 bits.
// Supported: q4 with G a multiple of 32; q8 with G 16 or a multiple of 32; K a multiple of 32 and of G.
#pragma once
#if defined(__ARM_NEON) && !defined(FERRY_PORTABLE)
#define FERRY_NEON_GEMV 1
#include <arm_neon.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace ferry_neon {

constexpr int64_t GEMV_MAX_ROWS = 4;  // activation rows per call (the decode path)

// Packed weights of N output rows (the fields of ferry_quant::Packed, without torch).
struct PackedWeights {
  const uint8_t* codes;  // [N, row_bytes]
  int64_t row_bytes;     // K / 2 (q4) or K (q8)
  const void* scales;    // [N, groups]: float, or IEEE fp16 bits (uint16_t) when f16
  const void* mins;      // like scales; nullptr when symmetric
  int64_t groups;        // K / G
  int64_t G;
  bool f16;
  bool q4;
};

// x quantized per 32-element block: codes in natural order, the blocks' scales, and per weight group
// the sum of d * code (the rounded x) for the min term.
struct Int8Acts {
  int64_t M = 0, K = 0, G = 0, blocks = 0, groups = 0;
  std::vector<int8_t> xq;   // [M, K]
  std::vector<float> dx;    // [M, blocks]
  std::vector<float> gsum;  // [M, groups]
};

inline bool gemv_supports(bool q4, int64_t K, int64_t G) {
  return G > 0 && K % 32 == 0 && K % G == 0 && (G % 32 == 0 || (!q4 && G == 16));
}

// n fp32 or fp16 values at base[at, at + n) as fp32 into dst.
inline void load_f32(const void* base, bool f16, int64_t at, int64_t n, float* dst) {
  if (!f16) {
    std::memcpy(dst, static_cast<const float*>(base) + at, n * sizeof(float));
    return;
  }
  const uint16_t* p = static_cast<const uint16_t*>(base) + at;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) vst1q_f32(dst + i, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p + i))));
  if (i < n) {  // the last 1-3 through a zero-padded copy: never read past the array
    uint16_t h[4] = {0, 0, 0, 0};
    float f[4];
    std::memcpy(h, p + i, (n - i) * sizeof(uint16_t));
    vst1q_f32(f, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h))));
    std::memcpy(dst + i, f, (n - i) * sizeof(float));
  }
}

// x[0, 32) to int8 codes q[0, 32) and the code sums of elements 0-15 and 16-31; returns amax.
inline float quantize_block(const float* x, int8_t* q, int32_t sums[2]) {
  float32x4_t v[8], mx = vdupq_n_f32(0.f);
  for (int i = 0; i < 8; ++i) {
    v[i] = vld1q_f32(x + 4 * i);
    mx = vmaxq_f32(mx, vabsq_f32(v[i]));
  }
  const float amax = vmaxvq_f32(mx);
  const float32x4_t inv = vdupq_n_f32(amax > 0.f ? 127.f / amax : 0.f);
  int32x4_t c[8];
  for (int i = 0; i < 8; ++i) c[i] = vcvtnq_s32_f32(vmulq_f32(v[i], inv));  // nearest, ties to even
  for (int h = 0; h < 2; ++h) {  // |codes| <= 127: the saturating narrows are exact
    const int32x4_t* ch = c + 4 * h;
    const int16x8_t a = vcombine_s16(vqmovn_s32(ch[0]), vqmovn_s32(ch[1]));
    const int16x8_t b = vcombine_s16(vqmovn_s32(ch[2]), vqmovn_s32(ch[3]));
    vst1q_s8(q + 16 * h, vcombine_s8(vqmovn_s16(a), vqmovn_s16(b)));
    sums[h] = vaddvq_s32(vaddq_s32(vaddq_s32(ch[0], ch[1]), vaddq_s32(ch[2], ch[3])));
  }
  return amax;
}

// x [M, K] (fp32, row-major) quantized for weights with groups of G.
inline Int8Acts quantize_acts(const float* x, int64_t M, int64_t K, int64_t G) {
  Int8Acts a;
  a.M = M, a.K = K, a.G = G, a.blocks = K / 32, a.groups = K / G;
  a.xq.assign(M * K, 0);
  a.dx.assign(M * a.blocks, 0.f);
  a.gsum.assign(M * a.groups, 0.f);
  for (int64_t m = 0; m < M; ++m) {
    float* gs = a.gsum.data() + m * a.groups;
    for (int64_t b = 0; b < a.blocks; ++b) {
      int32_t s[2];
      const float d = quantize_block(x + m * K + 32 * b, a.xq.data() + m * K + 32 * b, s) / 127.f;
      a.dx[m * a.blocks + b] = d;
      if (G == 16) {
        gs[2 * b] += d * static_cast<float>(s[0]);
        gs[2 * b + 1] += d * static_cast<float>(s[1]);
      } else {
        gs[(32 * b) / G] += d * static_cast<float>(s[0] + s[1]);
      }
    }
  }
  return a;
}

// acc + the products of 16 weight codes and 16 x codes, summed into 4 int32 lanes.
inline int32x4_t dot16(int32x4_t acc, int8x16_t w, int8x16_t x) {
#if defined(__ARM_FEATURE_DOTPROD)
  return vdotq_s32(acc, w, x);
#else
  // a product is at most 128 * 127 in magnitude: int16 holds it; SADALP adds pairs into int32
  acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(w), vget_low_s8(x)));
  return vpadalq_s16(acc, vmull_high_s8(w, x));
#endif
}

// The 32 weight codes of block b of a row: w[0] elements 0-15, w[1] elements 16-31.
template <bool Q4>
inline void load_block(const uint8_t* row, int64_t b, int8x16_t w[2]) {
  if constexpr (Q4) {
    const uint8x16_t raw = vld1q_u8(row + 16 * b);
    w[0] = vreinterpretq_s8_u8(vandq_u8(raw, vdupq_n_u8(0x0F)));
    w[1] = vreinterpretq_s8_u8(vshrq_n_u8(raw, 4));
  } else {
    const int8_t* p = reinterpret_cast<const int8_t*>(row) + 32 * b;
    w[0] = vld1q_s8(p);
    w[1] = vld1q_s8(p + 16);
  }
}

// Weight scale of each unit u in [u0, u1) of row n into ws[u - u0]; a unit is a block of 32 elements,
// or half of one with 16-element groups (G16).
template <bool G16>
inline void unit_scales(const PackedWeights& w, int64_t n, int64_t u0, int64_t u1, float* ws) {
  if constexpr (G16) {
    load_f32(w.scales, w.f16, n * w.groups + u0, u1 - u0, ws);
  } else {
    const int64_t g0 = (32 * u0) / w.G, g1 = (32 * (u1 - 1)) / w.G + 1;
    float gs[65];  // the caller's chunk (64 units) spans at most 65 groups
    load_f32(w.scales, w.f16, n * w.groups + g0, g1 - g0, gs);
    for (int64_t u = u0; u < u1; ++u) ws[u - u0] = gs[(32 * u) / w.G - g0];
  }
}

// Output rows n0..n0+NB-1 times activation rows 0..MB-1 (no min term): out[m * ldo + j]. Each (row,
// x row) pair keeps a float32x4 accumulator (16 of NEON's 32 registers at most); the factor weight
// scale * x scale of each unit is made beforehand, 64 blocks at a time.
template <bool Q4, bool G16, int NB, int MB>
inline void tile(const PackedWeights& w, const Int8Acts& a, int64_t n0, float* out, int64_t ldo) {
  constexpr int64_t CH = 64, UPB = G16 ? 2 : 1;
  float32x4_t acc[NB][MB];
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < MB; ++m) acc[j][m] = vdupq_n_f32(0.f);
  const uint8_t* rows[NB];
  for (int j = 0; j < NB; ++j) rows[j] = w.codes + (n0 + j) * w.row_bytes;
  float ws[CH * UPB], coef[NB][MB][CH * UPB];
  for (int64_t b0 = 0; b0 < a.blocks; b0 += CH) {
    const int64_t b1 = std::min(a.blocks, b0 + CH);
    for (int j = 0; j < NB; ++j) {
      unit_scales<G16>(w, n0 + j, b0 * UPB, b1 * UPB, ws);
      for (int m = 0; m < MB; ++m)
        for (int64_t u = 0; u < (b1 - b0) * UPB; ++u) coef[j][m][u] = ws[u] * a.dx[m * a.blocks + b0 + u / UPB];
    }
    for (int64_t b = b0; b < b1; ++b) {
      int8x16_t wv[NB][2];
      for (int j = 0; j < NB; ++j) {
        __builtin_prefetch(rows[j] + (Q4 ? 16 : 32) * b + 1024);
        load_block<Q4>(rows[j], b, wv[j]);
      }
      const int64_t u = (b - b0) * UPB;
      for (int m = 0; m < MB; ++m) {
        const int8_t* xp = a.xq.data() + m * a.K + 32 * b;
        const int8x16_t x0 = vld1q_s8(xp), x1 = vld1q_s8(xp + 16);
        for (int j = 0; j < NB; ++j) {
          const int32x4_t zero = vdupq_n_s32(0);
          if constexpr (G16) {  // the halves belong to two groups
            acc[j][m] = vfmaq_n_f32(acc[j][m], vcvtq_f32_s32(dot16(zero, wv[j][0], x0)), coef[j][m][u]);
            acc[j][m] = vfmaq_n_f32(acc[j][m], vcvtq_f32_s32(dot16(zero, wv[j][1], x1)), coef[j][m][u + 1]);
          } else {
            const int32x4_t s = dot16(dot16(zero, wv[j][0], x0), wv[j][1], x1);
            acc[j][m] = vfmaq_n_f32(acc[j][m], vcvtq_f32_s32(s), coef[j][m][u]);
          }
        }
      }
    }
  }
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < MB; ++m) out[m * ldo + j] = vaddvq_f32(acc[j][m]);
}

// Sum over groups of row n's min times gsum (the rounded x summed over the group).
inline float min_term(const PackedWeights& w, int64_t n, const float* gsum) {
  float buf[64];
  float32x4_t acc = vdupq_n_f32(0.f);
  float s = 0.f;
  for (int64_t g0 = 0; g0 < w.groups; g0 += 64) {
    const int64_t c = std::min<int64_t>(64, w.groups - g0);
    load_f32(w.mins, w.f16, n * w.groups + g0, c, buf);
    int64_t i = 0;
    for (; i + 4 <= c; i += 4) acc = vfmaq_f32(acc, vld1q_f32(buf + i), vld1q_f32(gsum + g0 + i));
    for (; i < c; ++i) s += buf[i] * gsum[g0 + i];
  }
  return s + vaddvq_f32(acc);
}

template <bool Q4, bool G16, int MB>
inline void rows_m(const PackedWeights& w, const Int8Acts& a, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) tile<Q4, G16, 4, MB>(w, a, n, y + n, ldy);
  for (; n < n1; ++n) tile<Q4, G16, 1, MB>(w, a, n, y + n, ldy);
}

template <bool Q4, bool G16>
inline void rows(const PackedWeights& w, const Int8Acts& a, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  switch (a.M) {
    case 1: rows_m<Q4, G16, 1>(w, a, n0, n1, y, ldy); break;
    case 2: rows_m<Q4, G16, 2>(w, a, n0, n1, y, ldy); break;
    case 3: rows_m<Q4, G16, 3>(w, a, n0, n1, y, ldy); break;
    default: rows_m<Q4, G16, 4>(w, a, n0, n1, y, ldy); break;
  }
}

// y[m * ldy + n] = (x W^T)[m, n] for output rows n in [n0, n1) and every row m of `a` (1 <= a.M <= 4,
// a quantized for w.G). The caller checks gemv_supports and splits N across threads.
inline void gemv_rows(const PackedWeights& w, const Int8Acts& a, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  if (w.q4) rows<true, false>(w, a, n0, n1, y, ldy);
  else if (w.G == 16) rows<false, true>(w, a, n0, n1, y, ldy);
  else rows<false, false>(w, a, n0, n1, y, ldy);
  if (!w.mins) return;
  for (int64_t m = 0; m < a.M; ++m)
    for (int64_t n = n0; n < n1; ++n) y[m * ldy + n] += min_term(w, n, a.gsum.data() + m * a.groups);
}

}  // namespace ferry_neon
#endif
