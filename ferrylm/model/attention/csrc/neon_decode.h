// The ARM NEON paged decode attention over fp32 caches: one query token per sequence, K/V rows read
// in place through the block table, GQA, scores and softmax in fp32 (paged_decode.cpp's generic
// decode_kernel is the reference; paged_decode.cpp is the glue that calls this from the torch op).
//
// Torch-free (raw pointers, std::vector) so it is tested without an aarch64 torch, under qemu
// (tests/csrc/neon_kernels_test.cpp). Everything here exists only where NEON may be used
// (`FERRY_NEON_DECODE` is then defined); elsewhere, and in the portable build, the header is empty.
//
// One task per (sequence, KV head), as the x86 fast paths: the task holds its query group, so every
// K/V row is read once. Scores keep up to 4 heads' accumulators while a K row streams by; values keep
// 4 heads x 16 output floats in registers while the V rows of the sequence stream by.
// Caches: [num_blocks, block_size, Hkv, D] fp32; token t of sequence b is in slot
// tables[b * max_blocks + t / block_size] * block_size + t % block_size.
#pragma once
#if defined(__ARM_NEON) && !defined(FERRY_PORTABLE)
#define FERRY_NEON_DECODE 1
#include <arm_neon.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace ferry_neon {

// exp(x) for x <= 0 (softmax after subtracting the max), as paged_decode.cpp's exp256: 2^n * p(r) with
// n = round(x log2 e), r = x - n ln 2 in two parts, p the degree-6 Taylor polynomial (relative error
// < 2e-7 on |r| <= ln2 / 2). 2^n is added to p's exponent as an integer, exact while the result is
// normal (n >= -125); below that the lane is 0 (the true value is under 2^-125). -inf gives 0.
inline float32x4_t exp4(float32x4_t x) {
  x = vmaxq_f32(x, vdupq_n_f32(-104.f));
  const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
  float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693145751953125f));  // x - n * ln2_hi (exact product)
  r = vfmsq_f32(r, n, vdupq_n_f32(1.428606765330187045e-06f));       // - n * ln2_lo
  float32x4_t p = vdupq_n_f32(1.f / 720.f);
  p = vfmaq_f32(vdupq_n_f32(1.f / 120.f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.f / 24.f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.f / 6.f), p, r);
  p = vfmaq_f32(vdupq_n_f32(0.5f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.f), p, r);
  const int32x4_t e = vshlq_n_s32(vcvtq_s32_f32(n), 23);
  const float32x4_t y = vreinterpretq_f32_s32(vaddq_s32(vreinterpretq_s32_f32(p), e));
  return vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(y), vcgeq_f32(n, vdupq_n_f32(-125.f))));
}

// a . b over n floats: four independent FMA chains, one reduction at the end.
inline float dot(const float* a, const float* b, int64_t n) {
  float32x4_t s0 = vdupq_n_f32(0.f), s1 = s0, s2 = s0, s3 = s0;
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    s0 = vfmaq_f32(s0, vld1q_f32(a + d), vld1q_f32(b + d));
    s1 = vfmaq_f32(s1, vld1q_f32(a + d + 4), vld1q_f32(b + d + 4));
    s2 = vfmaq_f32(s2, vld1q_f32(a + d + 8), vld1q_f32(b + d + 8));
    s3 = vfmaq_f32(s3, vld1q_f32(a + d + 12), vld1q_f32(b + d + 12));
  }
  for (; d + 4 <= n; d += 4) s0 = vfmaq_f32(s0, vld1q_f32(a + d), vld1q_f32(b + d));
  float s = vaddvq_f32(vaddq_f32(vaddq_f32(s0, s1), vaddq_f32(s2, s3)));
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

// acc[0, n) += p * v[0, n).
inline void axpy(float p, const float* v, float* acc, int64_t n) {
  int64_t d = 0;
  for (; d + 4 <= n; d += 4) vst1q_f32(acc + d, vfmaq_n_f32(vld1q_f32(acc + d), vld1q_f32(v + d), p));
  for (; d < n; ++d) acc[d] += p * v[d];
}

// s[0, S) <- softmax(s[0, S)) in place; every score, the last 1-3 too, goes through exp4.
inline void softmax_(float* s, int64_t S) {
  float32x4_t vm = vdupq_n_f32(-INFINITY);
  int64_t t = 0;
  for (; t + 4 <= S; t += 4) vm = vmaxq_f32(vm, vld1q_f32(s + t));
  float m = vmaxvq_f32(vm);
  for (; t < S; ++t) m = std::max(m, s[t]);
  const float32x4_t mv = vdupq_n_f32(m);
  float32x4_t vs = vdupq_n_f32(0.f);
  for (t = 0; t + 4 <= S; t += 4) {
    const float32x4_t e = exp4(vsubq_f32(vld1q_f32(s + t), mv));
    vst1q_f32(s + t, e);
    vs = vaddq_f32(vs, e);
  }
  if (t < S) {  // padded with -inf, whose exp4 is 0
    float tail[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
    std::copy(s + t, s + S, tail);
    const float32x4_t e = exp4(vsubq_f32(vld1q_f32(tail), mv));
    vst1q_f32(tail, e);
    vs = vaddq_f32(vs, e);
    std::copy(tail, tail + (S - t), s + t);
  }
  const float inv = 1.f / vaddvq_f32(vs);
  for (t = 0; t < S; ++t) s[t] *= inv;
}

// Scores of GB heads (q: [GB, D], already scaled) against the K rows at `rows[t]`: sc[g * ld + t].
// D a multiple of 8: two accumulators per head, so 2 * GB FMA chains run side by side.
template <int GB>
inline void score_block(const float* q, const float* const* rows, int64_t S, int64_t D, float* sc, int64_t ld) {
  for (int64_t t = 0; t < S; ++t) {
    const float* k = rows[t];
    float32x4_t acc[GB][2];
    for (int g = 0; g < GB; ++g) acc[g][0] = acc[g][1] = vdupq_n_f32(0.f);
    for (int64_t d = 0; d < D; d += 8) {
      const float32x4_t k0 = vld1q_f32(k + d), k1 = vld1q_f32(k + d + 4);
      for (int g = 0; g < GB; ++g) {
        acc[g][0] = vfmaq_f32(acc[g][0], vld1q_f32(q + g * D + d), k0);
        acc[g][1] = vfmaq_f32(acc[g][1], vld1q_f32(q + g * D + d + 4), k1);
      }
    }
    for (int g = 0; g < GB; ++g) sc[g * ld + t] = vaddvq_f32(vaddq_f32(acc[g][0], acc[g][1]));
  }
}

// out[g * D + c, +16) = sum over t of w[g * ld + t] * V row t, for GB heads and the 16 floats at c:
// 4 * GB accumulators stay in registers while the rows stream by.
template <int GB>
inline void value_block(const float* w, int64_t ld, const float* const* rows, int64_t S, int64_t D, int64_t c,
                        float* out) {
  float32x4_t acc[GB][4];
  for (int g = 0; g < GB; ++g)
    for (int i = 0; i < 4; ++i) acc[g][i] = vdupq_n_f32(0.f);
  for (int64_t t = 0; t < S; ++t) {
    const float* v = rows[t] + c;
    const float32x4_t v0 = vld1q_f32(v), v1 = vld1q_f32(v + 4), v2 = vld1q_f32(v + 8), v3 = vld1q_f32(v + 12);
    for (int g = 0; g < GB; ++g) {
      const float p = w[g * ld + t];
      acc[g][0] = vfmaq_n_f32(acc[g][0], v0, p);
      acc[g][1] = vfmaq_n_f32(acc[g][1], v1, p);
      acc[g][2] = vfmaq_n_f32(acc[g][2], v2, p);
      acc[g][3] = vfmaq_n_f32(acc[g][3], v3, p);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int i = 0; i < 4; ++i) vst1q_f32(out + g * D + c + 4 * i, acc[g][i]);
}

// Calls f(integral_constant<int, GB>, g0) for blocks of at most 4 heads covering [0, G).
template <typename F>
inline void for_head_blocks(int64_t G, F&& f) {
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    switch (std::min<int64_t>(4, G - g0)) {
      case 1: f(std::integral_constant<int, 1>{}, g0); break;
      case 2: f(std::integral_constant<int, 2>{}, g0); break;
      case 3: f(std::integral_constant<int, 3>{}, g0); break;
      default: f(std::integral_constant<int, 4>{}, g0); break;
    }
  }
}

// Per-thread buffers of decode_attention_tasks, reused across its tasks.
struct DecodeScratch {
  std::vector<float> q, scores, out;
  std::vector<const float*> krows, vrows;
};

// Attention of one query group (q: [G, D], scaled) over S tokens whose K / V rows are krows / vrows.
inline void decode_group(const float* q, int64_t G, int64_t D, int64_t S, DecodeScratch& s, float* out) {
  s.scores.resize(G * S);
  float* sc = s.scores.data();
  if (D % 8 == 0) {
    for_head_blocks(G, [&](auto gb, int64_t g0) {
      score_block<decltype(gb)::value>(q + g0 * D, s.krows.data(), S, D, sc + g0 * S, S);
    });
  } else {
    for (int64_t t = 0; t < S; ++t)
      for (int64_t g = 0; g < G; ++g) sc[g * S + t] = dot(q + g * D, s.krows[t], D);
  }
  for (int64_t g = 0; g < G; ++g) softmax_(sc + g * S, S);
  const int64_t Dv = D / 16 * 16;  // 16-float chunks in registers; the rest (D % 16) by axpy
  for_head_blocks(G, [&](auto gb, int64_t g0) {
    for (int64_t c = 0; c < Dv; c += 16)
      value_block<decltype(gb)::value>(sc + g0 * S, S, s.vrows.data(), S, D, c, out + g0 * D);
  });
  if (Dv == D) return;
  for (int64_t g = 0; g < G; ++g) {
    std::fill(out + g * D + Dv, out + (g + 1) * D, 0.f);
    for (int64_t t = 0; t < S; ++t) axpy(sc[g * S + t], s.vrows[t] + Dv, out + g * D + Dv, D - Dv);
  }
}

// Tasks [task0, task1) of paged decode attention, task = b * Hkv + kvh (the glue splits them across
// threads). q, out: [B, H, D]; caches: [num_blocks, block_size, Hkv, D]; tables: [B, max_blocks];
// query head h reads KV head h / (H / Hkv); scores are scaled by `scale`. window > 0: only the last
// `window` keys of each sequence (sliding-window layers); 0: all of them.
inline void decode_attention_tasks(const float* q, const float* k_cache, const float* v_cache, const int64_t* tables,
                                   const int64_t* seq_lens, float* out, int64_t H, int64_t Hkv, int64_t D,
                                   int64_t block_size, int64_t max_blocks, float scale, int64_t task0,
                                   int64_t task1, int64_t window = 0) {
  const int64_t G = H / Hkv;
  DecodeScratch s;
  s.q.resize(G * D);
  s.out.resize(G * D);
  for (int64_t task = task0; task < task1; ++task) {
    const int64_t b = task / Hkv, kvh = task % Hkv, end = seq_lens[b];
    const int64_t lo = window > 0 && end > window ? end - window : 0, S = end - lo;
    const int64_t first = (b * H + kvh * G) * D;  // the group's heads are adjacent in q and out
    if (S <= 0) {
      std::fill(out + first, out + first + G * D, 0.f);
      continue;
    }
    const int64_t* table = tables + b * max_blocks;
    s.krows.resize(S);
    s.vrows.resize(S);
    for (int64_t t = 0, blk = lo / block_size, i = lo % block_size; t < S; ++blk, i = 0)
      for (int64_t slot = table[blk] * block_size; i < block_size && t < S; ++i, ++t) {
        const int64_t at = ((slot + i) * Hkv + kvh) * D;
        s.krows[t] = k_cache + at;
        s.vrows[t] = v_cache + at;
      }
    for (int64_t i = 0; i < G * D; ++i) s.q[i] = q[first + i] * scale;
    decode_group(s.q.data(), G, D, S, s, s.out.data());
    std::copy(s.out.begin(), s.out.end(), out + first);
  }
}

// The whole batch on the calling thread: the generic decode_kernel's signature, fp32 only.
inline void decode_attention(const float* q, const float* k_cache, const float* v_cache, const int64_t* tables,
                             const int64_t* seq_lens, float* out, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                             int64_t block_size, int64_t max_blocks, float scale, int64_t window = 0) {
  decode_attention_tasks(q, k_cache, v_cache, tables, seq_lens, out, H, Hkv, D, block_size, max_blocks, scale, 0,
                         B * Hkv, window);
}

}  // namespace ferry_neon
#endif
