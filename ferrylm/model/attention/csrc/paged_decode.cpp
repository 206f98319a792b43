// Paged decode attention for the CPU: one query token per sequence, K/V read in place through
// the block table (no gather copy). Each task serves the whole query group of its KV head, so every
// K/V row is read once. Scores and softmax in fp32. With AVX-512, or AVX2 + FMA + F16C, and head_dim
// 32 / 64 / 128 a register-blocked fast path (namespace fastpath, one per instruction set) runs; other
// shapes, and the portable build (no SIMD flags), take the generic kernel, whose helpers (exp,
// softmax, dot, axpy, row widening) are vectorised for AVX-512 and AVX2 too. On ARM (the neon variant)
// fp32 caches take neon_decode.h; other cache dtypes the generic kernel.
//
// Quantized caches (--kv-cache-dtype, layout in attention/kv_quant.py): 1-byte codes, scales
// stored right after the codes in the same allocation. fp8 (e4m3 / e5m2): one fp32 per-tensor
// scale, a row widened through a 256-entry table. int8: one fp16 scale per (token, KV head) row.
// write_kv_quant_ quantizes this step's rows exactly as kv_quant.quantize does.
//
// Sliding-window layers (Gemma 3) pass window > 0: each sequence attends only to its last `window`
// keys (positions S - window .. S - 1); every path starts its token loop there. 0: all keys.
#include "neon_decode.h"
#include "../../csrc/torch_lite.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <array>
#include <cmath>
#include <math.h>
#include <type_traits>
#include <vector>

template <typename T>
static inline float to_f(T x) { return static_cast<float>(x); }

// The first key position a query at position S - 1 sees under `window` (0: no window).
static inline int64_t window_start(int64_t S, int64_t window) { return window > 0 && S > window ? S - window : 0; }

// slots[0, S - lo) <- the cache slots of positions lo .. S - 1 through a block table, with no division
// per token (it cost ~40 cycles each).
static inline void fill_slots(const int64_t* table, int64_t block_size, int64_t lo, int64_t S, int64_t* slots) {
  int64_t n = 0;
  for (int64_t t = lo, blk = lo / block_size, i = lo % block_size; t < S; ++blk, i = 0)
    for (const int64_t base = table[blk] * block_size; i < block_size && t < S; ++i, ++t) slots[n++] = base + i;
}

// Widen one K/V row to fp32. The bf16 case is a plain 16-bit shift on the raw bits so the
// compiler vectorises it (the generic conversion did not, and capped the kernel at ~4 GB/s).
template <typename T>
static inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}

template <>
inline void load_row<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t d = 0; d < n; ++d) out[d] = static_cast<uint32_t>(raw[d]) << 16;
}

#if defined(__AVX512F__)
#include <immintrin.h>
// exp(x) for x <= 0 (softmax after subtracting the max): 2^n * p(r), n = round(x log2 e), r = x - n ln 2
// in two parts, p the degree-6 Taylor polynomial (relative error < 2e-7 on |r| <= ln2 / 2); scalef
// gives 0 where 2^n underflows. The scalar expf of the generic loop cost ~10 ns a score: with 9 heads
// and 64 sequences of 144 tokens that alone was most of a 1.3 ms layer.
static inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
// exp512 on 8 lanes, the same reduction and polynomial. AVX2 has no scalef: 2^n is added to p's
// exponent field as an integer, exact while the result stays normal (p >= 0.7, so n >= -125); below
// that the true value is under 2^-125 and the lane is 0 (exp512 gives a denormal: no softmax weight
// notices). Lanes with x > 0 (only the masked tail of softmax_ makes them) are garbage, never used.
static inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-104.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(1.f / 720.f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  const __m256 y = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
  return _mm256_and_ps(y, _mm256_cmp_ps(n, _mm256_set1_ps(-125.f), _CMP_GE_OQ));
}

static inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float hmax256(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// All-ones in lanes [0, n), n < 8: AVX2's stand-in for a mask register.
static inline __m256i tail_mask(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#endif

// sh[0..S) <- softmax(sh[0..S)) in place.
static inline void softmax_(float* sh, int64_t S) {
  int64_t t = 0;
  float m = -INFINITY, sum = 0.f;
#if defined(__AVX512F__)
  __m512 vm = _mm512_set1_ps(-INFINITY);
  for (; t + 16 <= S; t += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(sh + t));
  m = _mm512_reduce_max_ps(vm);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 vm = _mm256_set1_ps(-INFINITY);
  for (; t + 8 <= S; t += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(sh + t));
  m = hmax256(vm);
#endif
  for (; t < S; ++t) m = std::max(m, sh[t]);
  t = 0;
#if defined(__AVX512F__)
  __m512 vs = _mm512_setzero_ps();
  const __m512 mv = _mm512_set1_ps(m);
  for (; t + 16 <= S; t += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sh + t), mv));
    _mm512_storeu_ps(sh + t, e);
    vs = _mm512_add_ps(vs, e);
  }
  if (t < S) {  // the tail through the same exp, so every score is computed alike
    const __mmask16 k = static_cast<__mmask16>((1u << (S - t)) - 1);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sh + t), mv));
    _mm512_mask_storeu_ps(sh + t, k, e);
    vs = _mm512_add_ps(vs, _mm512_maskz_mov_ps(k, e));
    t = S;
  }
  sum = _mm512_reduce_add_ps(vs);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 vs = _mm256_setzero_ps();
  const __m256 mv = _mm256_set1_ps(m);
  for (; t + 8 <= S; t += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sh + t), mv));
    _mm256_storeu_ps(sh + t, e);
    vs = _mm256_add_ps(vs, e);
  }
  if (t < S) {  // the tail through the same exp; its masked-off lanes are dropped from the sum
    const __m256i k = tail_mask(S - t);
    const __m256 e = exp256(_mm256_sub_ps(_mm256_maskload_ps(sh + t, k), mv));
    _mm256_maskstore_ps(sh + t, k, e);
    vs = _mm256_add_ps(vs, _mm256_and_ps(e, _mm256_castsi256_ps(k)));
    t = S;
  }
  sum = hsum256(vs);
#endif
  for (; t < S; ++t) { sh[t] = expf(sh[t] - m); sum += sh[t]; }
  const float inv = 1.f / sum;
  for (t = 0; t < S; ++t) sh[t] *= inv;
}

// acc[0..n) += p * v[0..n).
static inline void axpy(float p, const float* v, float* acc, int64_t n) {
  int64_t d = 0;
#if defined(__AVX512F__)
  const __m512 pv = _mm512_set1_ps(p);
  for (; d + 16 <= n; d += 16) _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(pv, _mm512_loadu_ps(v + d), _mm512_loadu_ps(acc + d)));
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 pv = _mm256_set1_ps(p);
  for (; d + 8 <= n; d += 8)
    _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + d), _mm256_loadu_ps(acc + d)));
#endif
  for (; d < n; ++d) acc[d] += p * v[d];
}

// Dot product with 16 independent lanes (a tree reduction at the end with AVX-512 or AVX2).
static inline float dot(const float* a, const float* b, int64_t n) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < n; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
    return _mm512_reduce_add_ps(acc);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (n % 8 == 0) {  // two accumulators: one FMA chain would wait on its latency every step
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 16 <= n; d += 16) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), a1);
    }
    if (d < n) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), a0);
    return hsum256(_mm256_add_ps(a0, a1));
  }
#endif
  float lanes[16] = {0.f};
  int64_t d = 0;
  for (; d + 16 <= n; d += 16)
    for (int j = 0; j < 16; ++j) lanes[j] += a[d + j] * b[d + j];
  float s = 0.f;
  for (int j = 0; j < 16; ++j) s += lanes[j];
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

// Rows of a cache, widened to fp32 one token ([Hkv, D], contiguous) at a time.
template <typename T>
struct PlainRows {
  const T* base;
  int64_t W;
  inline void load(int64_t slot, float* dst) const { load_row(base + slot * W, dst, W); }
};

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 16 fp8 codes as fp32 through fp16, which holds every fp8 value exactly: an e5m2 byte is the top byte
// of its fp16; an e4m3 byte, its exponent and mantissa shifted into fp16's fields, is the value times
// 2^-8 (subnormals included; the caller multiplies by 256). NaN codes aside: writes saturate.
static inline __m512 fp8x16_to_f32(const uint8_t* src, bool e4m3) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  const __m256i h = e4m3 ? _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7),
                                           _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8))
                         : _mm256_slli_epi16(b, 8);
  return _mm512_cvtph_ps(h);
}
#elif defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
// fp8x16_to_f32 on 8 codes, the fp16 conversion by F16C. e4m3: the sign-extended code << 7 puts the
// sign in bit 15 and the other fields in place, and sets bit 14 too when negative, which the mask clears.
static inline __m256 fp8x8_to_f32(const uint8_t* src, bool e4m3) {
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src));
  const __m128i h = e4m3 ? _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(raw), 7), _mm_set1_epi16(-0x4001))
                         : _mm_slli_epi16(_mm_cvtepu8_epi16(raw), 8);
  return _mm256_cvtph_ps(h);
}
#endif

// fp8 codes through a table of their 256 fp32 values, times the per-tensor scale.
struct Fp8Rows {
  const uint8_t* base;
  const float* table;
  float scale;
  int64_t W;
  bool e4m3;
  inline void load(int64_t slot, float* dst) const {
    const uint8_t* src = base + slot * W;
    int64_t d = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    // 16 codes at a time (fp8x16_to_f32), bit for bit the table's values; the lookup ran ~1 element a cycle.
    const __m512 mul = _mm512_set1_ps(e4m3 ? 256.f * scale : scale);
    for (; d + 16 <= W; d += 16) _mm512_storeu_ps(dst + d, _mm512_mul_ps(fp8x16_to_f32(src + d, e4m3), mul));
#elif defined(__AVX2__) && defined(__F16C__)
    const __m256 mul = _mm256_set1_ps(e4m3 ? 256.f * scale : scale);
    for (; d + 8 <= W; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(fp8x8_to_f32(src + d, e4m3), mul));
#endif
    for (; d < W; ++d) dst[d] = table[src[d]] * scale;
  }
};

// int8 codes times the fp16 scale of their (token, KV head) row.
struct Int8Rows {
  const int8_t* base;
  const c10::Half* scales;  // [slots, Hkv]
  int64_t Hkv, D;
  inline void load(int64_t slot, float* dst) const {
    const int8_t* src = base + slot * Hkv * D;
    for (int64_t h = 0; h < Hkv; ++h) {
      const float s = static_cast<float>(scales[slot * Hkv + h]);
      int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__)
      const __m256 sv = _mm256_set1_ps(s);
      for (; d + 8 <= D; d += 8) {
        const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + h * D + d));
        _mm256_storeu_ps(dst + h * D + d, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), sv));
      }
#endif
      for (; d < D; ++d) dst[h * D + d] = static_cast<float>(src[h * D + d]) * s;
    }
  }
};

template <typename F8>
static const float* fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = static_cast<float>(F8(static_cast<uint8_t>(i), F8::from_bits()));
    return t;
  }();
  return table.data();
}

// Byte offset of a quantized cache's scales (kv_quant._scale_offset) and a check that they exist.
static const uint8_t* scales_ptr(const torch::Tensor& cache, int64_t scale_bytes) {
  const int64_t offset = (cache.numel() + 3) / 4 * 4;
  TORCH_CHECK(cache.storage_offset() == 0 && cache.is_contiguous(),
              "a quantized KV cache must be the contiguous tensor kv_quant.allocate() returned");
  TORCH_CHECK(static_cast<int64_t>(cache.storage().nbytes()) >= offset + scale_bytes,
              "quantized KV cache without its scales: allocate it with kv_quant.allocate()");
  return static_cast<const uint8_t*>(cache.storage().data()) + offset;
}

static bool is_fp8(at::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }

template <typename scalar_t, typename Rows>
static void decode_kernel(const scalar_t* q, const Rows& kr, const Rows& vr, const int64_t* tables,
                          const int64_t* seq_lens, scalar_t* out, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                          int64_t block_size, int64_t max_blocks, float scale, int64_t window) {
  // One task per sequence: a cache row [Hkv, D] is contiguous, so reading all KV heads of a token
  // together uses every byte of each cache line (per-head tasks read a third of each line).
  const int64_t G = H / Hkv, W = Hkv * D;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(H * D), acc(H * D), scores, row(W);
    std::vector<int64_t> slots;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t lo = window_start(seq_lens[b], window), S = seq_lens[b] - lo;
      slots.resize(S);
      fill_slots(tables + b * max_blocks, block_size, lo, seq_lens[b], slots.data());
      load_row(q + b * H * D, qf.data(), H * D);
      for (int64_t i = 0; i < H * D; ++i) qf[i] *= scale;
      scores.resize(H * S);
      for (int64_t t = 0; t < S; ++t) {
        kr.load(slots[t], row.data());
        for (int64_t h = 0; h < H; ++h) scores[h * S + t] = dot(qf.data() + h * D, row.data() + (h / G) * D, D);
      }
      for (int64_t h = 0; h < H; ++h) softmax_(scores.data() + h * S, S);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < S; ++t) {
        vr.load(slots[t], row.data());
        for (int64_t h = 0; h < H; ++h) axpy(scores[h * S + t], row.data() + (h / G) * D, acc.data() + h * D, D);
      }
      for (int64_t i = 0; i < H * D; ++i) out[b * H * D + i] = static_cast<scalar_t>(acc[i]);
    }
  });
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define FERRY_FASTPATH 1
// The fast decode path (head_dim 32, 64 or 128): one task per (sequence, KV head), whose query group
// is held in registers. Scores: each token's partial products are one vector per head; 16 tokens'
// vectors are summed by one shuffle tree (reduce16) instead of 16 horizontal reductions. Values:
// the group's accumulators stay in registers while V rows stream by once. A per-row factor (the
// int8 scale, the fp8 per-tensor scale) multiplies the score or the softmax weight, never the row.
// A KV head's row of 64 bf16 is two whole cache lines, so per-head tasks waste no bandwidth.
namespace fastpath {

static inline __m512 widen16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 widen16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
static inline __m512 widen16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <typename T>
struct Plain {
  const T* base;
  int64_t Hkv, D;
  inline const T* row(int64_t slot, int64_t h) const { return base + (slot * Hkv + h) * D; }
  inline __m512 load(const T* r, int j) const { return widen16(r + 16 * j); }
  inline float mult(int64_t, int64_t) const { return 1.f; }
};

struct Int8 {
  const int8_t* base;
  const c10::Half* scales;  // [slots, Hkv]
  int64_t Hkv, D;
  inline const int8_t* row(int64_t slot, int64_t h) const { return base + (slot * Hkv + h) * D; }
  inline __m512 load(const int8_t* r, int j) const {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 16 * j))));
  }
  inline float mult(int64_t slot, int64_t h) const { return static_cast<float>(scales[slot * Hkv + h]); }
};

// fp8 through fp16 as in Fp8Rows::load; e4m3's 2^-8 is folded into the factor.
template <bool E4M3>
struct Fp8 {
  const uint8_t* base;
  float factor;
  int64_t Hkv, D;
  inline const uint8_t* row(int64_t slot, int64_t h) const { return base + (slot * Hkv + h) * D; }
  inline __m512 load(const uint8_t* r, int j) const { return fp8x16_to_f32(r + 16 * j, E4M3); }
  inline float mult(int64_t, int64_t) const { return factor; }
};

// v[0..16) are 16 rows of 16 floats; lane t of the result is the sum of row t. Four levels of
// pairwise shuffles (256-bit halves, 128-bit quarters, then within quarters) leave row j + 4k in
// lane 4j + k; one permute puts it in lane j + 4k.
static inline __m512 reduce16(const float (*v)[16]) {
  __m512 w[8], x[4], y[2];
  for (int k = 0; k < 8; ++k) {
    const __m512 a = _mm512_load_ps(v[2 * k]), b = _mm512_load_ps(v[2 * k + 1]);
    w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int k = 0; k < 4; ++k)
    x[k] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int k = 0; k < 2; ++k)
    y[k] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * k], x[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(x[2 * k], x[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, z);
}

// Software prefetch of a row PREFETCH tokens ahead: blocks sit anywhere in the pool, so the hardware
// prefetcher loses the stream at every block edge.
constexpr int64_t PREFETCH = 8;
template <typename T>
static inline void prefetch_row(const T* r, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(r) + o, _MM_HINT_T0);
}

template <int NV, typename scalar_t, typename Rows>
static void decode(const scalar_t* q, const Rows& kr, const Rows& vr, const int64_t* tables, const int64_t* seq_lens,
                   scalar_t* out, int64_t B, int64_t H, int64_t Hkv, int64_t block_size, int64_t max_blocks,
                   float scale, int64_t window) {
  constexpr int GB = 16 / NV;  // query heads held in registers at once (16 accumulators)
  constexpr int64_t D = 16 * NV;
  const int64_t G = H / Hkv;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sc;
    std::vector<int64_t> slots;
    alignas(64) float part[GB][16][16];
    alignas(64) float mult[16];
    alignas(64) float res[GB][D];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, kvh = task % Hkv, lo = window_start(seq_lens[b], window), S = seq_lens[b] - lo;
      const int64_t S_pad = (S + 15) / 16 * 16;
      slots.resize(S);
      fill_slots(tables + b * max_blocks, block_size, lo, seq_lens[b], slots.data());
      sc.assign((G + GB) * S_pad, 0.f);  // GB zero rows past the last head: weight 0 for a group's spare lanes
      for (int64_t g0 = 0; g0 < G; g0 += GB) {
        const int64_t gn = std::min<int64_t>(GB, G - g0);
        __m512 qv[GB][NV];
        for (int g = 0; g < GB; ++g)
          for (int j = 0; j < NV; ++j)
            qv[g][j] = g < gn ? _mm512_mul_ps(widen16(q + (b * H + kvh * G + g0 + g) * D + 16 * j), _mm512_set1_ps(scale))
                              : _mm512_setzero_ps();
        for (int64_t t0 = 0; t0 < S; t0 += 16) {
          const int64_t n = std::min<int64_t>(16, S - t0);
          for (int64_t i = 0; i < 16; ++i) {
            if (i >= n) {
              for (int g = 0; g < GB; ++g) _mm512_store_ps(part[g][i], _mm512_setzero_ps());
              mult[i] = 0.f;
              continue;
            }
            const int64_t slot = slots[t0 + i];
            const auto* r = kr.row(slot, kvh);
            if (t0 + i + PREFETCH < S) prefetch_row(kr.row(slots[t0 + i + PREFETCH], kvh), D * sizeof(*r));
            __m512 kv[NV];
            for (int j = 0; j < NV; ++j) kv[j] = kr.load(r, j);
            for (int g = 0; g < GB; ++g) {
              if (g >= gn) break;
              __m512 a = _mm512_mul_ps(qv[g][0], kv[0]);
              for (int j = 1; j < NV; ++j) a = _mm512_fmadd_ps(qv[g][j], kv[j], a);
              _mm512_store_ps(part[g][i], a);
            }
            mult[i] = kr.mult(slot, kvh);
          }
          const __m512 m = _mm512_load_ps(mult);
          for (int g = 0; g < GB; ++g) {
            if (g >= gn) break;
            _mm512_storeu_ps(sc.data() + (g0 + g) * S_pad + t0, _mm512_mul_ps(reduce16(part[g]), m));
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) softmax_(sc.data() + g * S_pad, S);
      for (int64_t g0 = 0; g0 < G; g0 += GB) {
        const int64_t gn = std::min<int64_t>(GB, G - g0);
        __m512 acc[GB][NV];
#pragma GCC unroll 16
        for (int g = 0; g < GB; ++g)
#pragma GCC unroll 16
          for (int j = 0; j < NV; ++j) acc[g][j] = _mm512_setzero_ps();
        const float* p0 = sc.data() + g0 * S_pad;
        for (int64_t t = 0; t < S; ++t) {
          const int64_t slot = slots[t];
          const auto* r = vr.row(slot, kvh);
          if (t + PREFETCH < S) prefetch_row(vr.row(slots[t + PREFETCH], kvh), D * sizeof(*r));
          const float m = vr.mult(slot, kvh);
          __m512 kv[NV];
          for (int j = 0; j < NV; ++j) kv[j] = vr.load(r, j);
#pragma GCC unroll 16
          for (int g = 0; g < GB; ++g) {  // every g, so the accumulators stay in registers; zero weight past gn
            const __m512 p = _mm512_set1_ps(p0[g * S_pad + t] * m);
#pragma GCC unroll 16
            for (int j = 0; j < NV; ++j) acc[g][j] = _mm512_fmadd_ps(p, kv[j], acc[g][j]);
          }
        }
#pragma GCC unroll 16
        for (int g = 0; g < GB; ++g)  // constant indices only, so acc is never addressed and stays in registers
#pragma GCC unroll 16
          for (int j = 0; j < NV; ++j) _mm512_store_ps(res[g] + 16 * j, acc[g][j]);
        for (int64_t g = 0; g < gn; ++g) {
          scalar_t* o = out + (b * H + kvh * G + g0 + g) * D;
          for (int64_t d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(res[g][d]);
        }
      }
    }
  });
}

// Runs the fast path and returns true where it applies (head_dim 32 / 64 / 128, whole query groups).
template <typename scalar_t, typename Rows>
static bool try_decode(const torch::Tensor& q, const Rows& kr, const Rows& vr, const torch::Tensor& tables,
                       const torch::Tensor& lens, torch::Tensor& out, int64_t Hkv, int64_t bs, float scale,
                       int64_t window) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  if (H % Hkv != 0) return false;
  auto run = [&](auto nv) {
    decode<decltype(nv)::value, scalar_t>(q.data_ptr<scalar_t>(), kr, vr, tables.data_ptr<int64_t>(),
                                          lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), B, H, Hkv, bs,
                                          tables.size(1), scale, window);
    return true;
  };
  switch (D) {
    case 32: return run(std::integral_constant<int, 2>{});
    case 64: return run(std::integral_constant<int, 4>{});
    case 128: return run(std::integral_constant<int, 8>{});
    default: return false;
  }
}

}  // namespace fastpath
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define FERRY_FASTPATH 1
// The AVX2 fast path (head_dim 32, 64 or 128): one task per (sequence, KV head) as above, but 16 ymm
// registers cannot hold a query group's accumulators (3 heads of 64 are 24 vectors). So the group is
// cut into blocks of at most 4 heads (each block reads the rows again, from cache after the first),
// and the V pass into column chunks of NC vectors: GB x NC accumulators, GB weights and one row
// vector fit 16 registers (3 x 4 + 3 + 1; a spilled accumulator costs a store-load chain per token).
// Scores: each token's partial products are one vector per head, and 8 tokens' vectors are summed
// by one shuffle tree (reduce8). Row factors as in the AVX-512 path.
namespace fastpath {

static inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 widen8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
static inline __m256 widen8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Row readers as in the AVX-512 path; kRegs: the ymm registers a load holds while it runs (its result,
// a mask constant), which value_block's register budget counts.
template <typename T>
struct Plain {
  static constexpr int kRegs = 1;
  const T* base;
  int64_t Hkv, D;
  inline const T* row(int64_t slot, int64_t h) const { return base + (slot * Hkv + h) * D; }
  inline __m256 load(const T* r, int64_t j) const { return widen8(r + 8 * j); }
  inline float mult(int64_t, int64_t) const { return 1.f; }
};

struct Int8 {
  static constexpr int kRegs = 1;
  const int8_t* base;
  const c10::Half* scales;  // [slots, Hkv]
  int64_t Hkv, D;
  inline const int8_t* row(int64_t slot, int64_t h) const { return base + (slot * Hkv + h) * D; }
  inline __m256 load(const int8_t* r, int64_t j) const {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + 8 * j))));
  }
  inline float mult(int64_t slot, int64_t h) const { return static_cast<float>(scales[slot * Hkv + h]); }
};

template <bool E4M3>
struct Fp8 {
  static constexpr int kRegs = E4M3 ? 2 : 1;
  const uint8_t* base;
  float factor;
  int64_t Hkv, D;
  inline const uint8_t* row(int64_t slot, int64_t h) const { return base + (slot * Hkv + h) * D; }
  inline __m256 load(const uint8_t* r, int64_t j) const { return fp8x8_to_f32(r + 8 * j, E4M3); }
  inline float mult(int64_t, int64_t) const { return factor; }
};

// v[0..8) are 8 rows of 8 floats; lane t of the result is the sum of row t. Two levels of hadd leave
// row t's low half summed in lane t of the low 128 bits (t < 4) or of the high (t >= 4), and its high
// half in the other 128 bits; the two 128-bit swaps add them up.
static inline __m256 reduce8(const float (*v)[8]) {
  __m256 h[4];
  for (int k = 0; k < 4; ++k) h[k] = _mm256_hadd_ps(_mm256_load_ps(v[2 * k]), _mm256_load_ps(v[2 * k + 1]));
  const __m256 a = _mm256_hadd_ps(h[0], h[1]), b = _mm256_hadd_ps(h[2], h[3]);
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// Software prefetch, PREFETCH tokens ahead: blocks sit anywhere in the pool (see the AVX-512 path).
// The K pass also pulls each V row into L2 (prefetch_row_l2), so the V pass's column chunks, which
// visit every row once per chunk, wait on L2 rather than on memory.
constexpr int64_t PREFETCH = 8;
template <typename T>
static inline void prefetch_row(const T* r, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(r) + o, _MM_HINT_T0);
}
template <typename T>
static inline void prefetch_row_l2(const T* r, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(r) + o, _MM_HINT_T1);
}

// part[g][i] <- the 8 lane sums of q[g] * row over head_dim, for the block's GB heads (q: [GB, D]).
template <int GB, typename Rows, typename T>
static inline void token_partials(const float* q, const Rows& kr, const T* r, int64_t D, float (*part)[8][8],
                                  int64_t i) {
  __m256 a[GB];
#pragma GCC unroll 4
  for (int g = 0; g < GB; ++g) a[g] = _mm256_setzero_ps();
  for (int64_t j = 0; j < D / 8; ++j) {
    const __m256 k = kr.load(r, j);
#pragma GCC unroll 4
    for (int g = 0; g < GB; ++g) a[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + 8 * j), k, a[g]);
  }
#pragma GCC unroll 4
  for (int g = 0; g < GB; ++g) _mm256_store_ps(part[g][i], a[g]);
}

// Scores of the block's GB heads (q: scaled, fp32, [GB, D]) against tokens [0, S) of KV head kvh,
// times each K row's factor, into sc (row stride S_pad: lanes past S are written, never read).
// vr_ahead: the V rows to pull into L2 on the way (the first block's pass only), or null.
template <int GB, typename Rows>
static void score_block(const float* q, const Rows& kr, const Rows* vr_ahead, const int64_t* slots, int64_t S,
                        int64_t kvh, int64_t D, float* sc, int64_t S_pad) {
  alignas(32) float part[GB][8][8];
  alignas(32) float mult[8];
  for (int64_t t0 = 0; t0 < S; t0 += 8) {
    for (int64_t i = 0; i < 8; ++i) {
      const int64_t t = t0 + i;
      if (t >= S) {
        for (int g = 0; g < GB; ++g) _mm256_store_ps(part[g][i], _mm256_setzero_ps());
        mult[i] = 0.f;
        continue;
      }
      const auto* r = kr.row(slots[t], kvh);
      if (t + PREFETCH < S) {
        prefetch_row(kr.row(slots[t + PREFETCH], kvh), D * sizeof(*r));
        if (vr_ahead) prefetch_row_l2(vr_ahead->row(slots[t + PREFETCH], kvh), D * sizeof(*r));
      }
      token_partials<GB>(q, kr, r, D, part, i);
      mult[i] = kr.mult(slots[t], kvh);
    }
    const __m256 m = _mm256_load_ps(mult);
    for (int g = 0; g < GB; ++g) _mm256_storeu_ps(sc + g * S_pad + t0, _mm256_mul_ps(reduce8(part[g]), m));
  }
}

// out[g][c, c + 8 NC) = sum over t of w[g][t] * row_t[c, c + 8 NC), for the block's GB heads: the
// accumulators stay in registers (constant indices only) while the rows' chunks stream by.
template <int GB, int NC, typename Rows>
static void value_tile(const float* w, int64_t S_pad, const Rows& vr, const int64_t* slots, int64_t S, int64_t kvh,
                       int64_t c, int64_t D, float* out) {
  __m256 acc[GB][NC];
#pragma GCC unroll 16
  for (int g = 0; g < GB; ++g)
#pragma GCC unroll 16
    for (int j = 0; j < NC; ++j) acc[g][j] = _mm256_setzero_ps();
  for (int64_t t = 0; t < S; ++t) {
    const auto* r = vr.row(slots[t], kvh);
    if (t + PREFETCH < S) prefetch_row(vr.row(slots[t + PREFETCH], kvh) + c, 8 * NC * sizeof(*r));
    __m256 p[GB];  // weights first, then one row vector at a time: GB + 1 live besides the accumulators
#pragma GCC unroll 16
    for (int g = 0; g < GB; ++g) p[g] = _mm256_broadcast_ss(w + g * S_pad + t);
#pragma GCC unroll 16
    for (int j = 0; j < NC; ++j) {
      const __m256 v = vr.load(r, c / 8 + j);
#pragma GCC unroll 16
      for (int g = 0; g < GB; ++g) acc[g][j] = _mm256_fmadd_ps(p[g], v, acc[g][j]);
    }
  }
#pragma GCC unroll 16
  for (int g = 0; g < GB; ++g)
#pragma GCC unroll 16
    for (int j = 0; j < NC; ++j) _mm256_storeu_ps(out + g * D + c + 8 * j, acc[g][j]);
}

// The block's outputs [GB, D] from its weights, chunk by chunk: chunks of 4 vectors where GB x 4
// accumulators, GB weights and the row load fit 16 registers, else of 2 (D a multiple of 32 either way).
template <int GB, typename Rows>
static void value_block(const float* w, int64_t S_pad, const Rows& vr, const int64_t* slots, int64_t S, int64_t kvh,
                        int64_t D, float* out) {
  constexpr int NC = GB * 4 + GB + Rows::kRegs <= 16 ? 4 : 2;
  for (int64_t c = 0; c < D; c += 8 * NC) value_tile<GB, NC>(w, S_pad, vr, slots, S, kvh, c, D, out);
}

// Calls f(integral_constant<int, GB>, g0) for blocks [g0, g0 + GB) of at most 4 heads covering
// [0, G), as equal as possible (7 heads: 4 + 3, not 4 + 3 padded to 4 + 4).
template <typename F>
static void for_each_block(int64_t G, F&& f) {
  const int64_t blocks = (G + 3) / 4;
  for (int64_t k = 0, g0 = 0; k < blocks; ++k) {
    const int64_t gn = G / blocks + (k < G % blocks ? 1 : 0);
    switch (gn) {
      case 1: f(std::integral_constant<int, 1>{}, g0); break;
      case 2: f(std::integral_constant<int, 2>{}, g0); break;
      case 3: f(std::integral_constant<int, 3>{}, g0); break;
      default: f(std::integral_constant<int, 4>{}, g0); break;
    }
    g0 += gn;
  }
}

// Attention of one KV head's query group (q: scaled, fp32, [G, D]) over tokens at `slots`: out [G, D].
template <typename Rows>
static void decode_group(const float* q, const Rows& kr, const Rows& vr, const int64_t* slots, int64_t S,
                         int64_t kvh, int64_t G, int64_t D, std::vector<float>& sc, float* out) {
  const int64_t S_pad = (S + 7) / 8 * 8;
  sc.resize(G * S_pad);
  for_each_block(G, [&](auto gb, int64_t g0) {
    score_block<decltype(gb)::value>(q + g0 * D, kr, g0 == 0 ? &vr : nullptr, slots, S, kvh, D,
                                     sc.data() + g0 * S_pad, S_pad);
  });
  for (int64_t g = 0; g < G; ++g) softmax_(sc.data() + g * S_pad, S);
  for (int64_t t = 0; t < S; ++t) {  // V's row factor goes on the weight, as in the AVX-512 path
    const float m = vr.mult(slots[t], kvh);
    for (int64_t g = 0; g < G; ++g) sc[g * S_pad + t] *= m;
  }
  for_each_block(G, [&](auto gb, int64_t g0) {
    value_block<decltype(gb)::value>(sc.data() + g0 * S_pad, S_pad, vr, slots, S, kvh, D, out + g0 * D);
  });
}

template <typename scalar_t, typename Rows>
static void decode(const scalar_t* q, const Rows& kr, const Rows& vr, const int64_t* tables, const int64_t* seq_lens,
                   scalar_t* out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t block_size,
                   int64_t max_blocks, float scale, int64_t window) {
  const int64_t G = H / Hkv;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sc, qs(G * D), res(G * D);
    std::vector<int64_t> slots;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, kvh = task % Hkv, lo = window_start(seq_lens[b], window), S = seq_lens[b] - lo;
      slots.resize(S);
      fill_slots(tables + b * max_blocks, block_size, lo, seq_lens[b], slots.data());
      const int64_t first = (b * H + kvh * G) * D;  // the group's heads are adjacent in q and out
      for (int64_t i = 0; i < G * D; ++i) qs[i] = static_cast<float>(q[first + i]) * scale;
      decode_group(qs.data(), kr, vr, slots.data(), S, kvh, G, D, sc, res.data());
      for (int64_t i = 0; i < G * D; ++i) out[first + i] = static_cast<scalar_t>(res[i]);
    }
  });
}

// Runs the fast path and returns true where it applies (head_dim 32 / 64 / 128, whole query groups).
template <typename scalar_t, typename Rows>
static bool try_decode(const torch::Tensor& q, const Rows& kr, const Rows& vr, const torch::Tensor& tables,
                       const torch::Tensor& lens, torch::Tensor& out, int64_t Hkv, int64_t bs, float scale,
                       int64_t window) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  if (H % Hkv != 0 || (D != 32 && D != 64 && D != 128)) return false;
  decode<scalar_t>(q.data_ptr<scalar_t>(), kr, vr, tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                   out.data_ptr<scalar_t>(), B, H, Hkv, D, bs, tables.size(1), scale, window);
  return true;
}

}  // namespace fastpath
#endif

// Both fast paths: each defines Plain, Int8, Fp8 and try_decode above.
#if defined(FERRY_FASTPATH)
namespace fastpath {

// The fast path for this cache's format, or false (the generic kernel runs instead).
template <typename scalar_t>
static bool fast_dispatch(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                          const torch::Tensor& tables, const torch::Tensor& lens, torch::Tensor& out, float scale,
                          int64_t window) {
  if constexpr (std::is_same_v<scalar_t, double>) {
    return false;
  } else {
  const int64_t D = q.size(2), Hkv = k_cache.size(2), bs = k_cache.size(1), slots = k_cache.size(0) * bs;
  const auto cache_type = k_cache.scalar_type();
  if (cache_type == at::kChar) {
    auto ks = reinterpret_cast<const c10::Half*>(scales_ptr(k_cache, slots * Hkv * 2));
    auto vs = reinterpret_cast<const c10::Half*>(scales_ptr(v_cache, slots * Hkv * 2));
    return try_decode<scalar_t>(q, Int8{static_cast<const int8_t*>(k_cache.data_ptr()), ks, Hkv, D},
                                Int8{static_cast<const int8_t*>(v_cache.data_ptr()), vs, Hkv, D}, tables, lens, out,
                                Hkv, bs, scale, window);
  }
  if (is_fp8(cache_type)) {
    const float k_scale = *reinterpret_cast<const float*>(scales_ptr(k_cache, 4));
    const float v_scale = *reinterpret_cast<const float*>(scales_ptr(v_cache, 4));
    if (cache_type == at::kFloat8_e4m3fn)
      return try_decode<scalar_t>(q, Fp8<true>{static_cast<const uint8_t*>(k_cache.data_ptr()), 256.f * k_scale, Hkv, D},
                                  Fp8<true>{static_cast<const uint8_t*>(v_cache.data_ptr()), 256.f * v_scale, Hkv, D},
                                  tables, lens, out, Hkv, bs, scale, window);
    return try_decode<scalar_t>(q, Fp8<false>{static_cast<const uint8_t*>(k_cache.data_ptr()), k_scale, Hkv, D},
                                Fp8<false>{static_cast<const uint8_t*>(v_cache.data_ptr()), v_scale, Hkv, D},
                                tables, lens, out, Hkv, bs, scale, window);
  }
  if (q.dtype() != k_cache.dtype()) return false;
  return try_decode<scalar_t>(q, Plain<scalar_t>{k_cache.data_ptr<scalar_t>(), Hkv, D},
                              Plain<scalar_t>{v_cache.data_ptr<scalar_t>(), Hkv, D}, tables, lens, out, Hkv, bs, scale,
                              window);
  }
}

}  // namespace fastpath
#endif

#if defined(__ARM_NEON) && !defined(FERRY_PORTABLE)
// fp32 caches on ARM: neon_decode.h, one task per (sequence, KV head).
static void decode_neon(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                        const torch::Tensor& tables, const torch::Tensor& lens, torch::Tensor& out, float scale,
                        int64_t window) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(2), bs = k_cache.size(1);
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "query heads ", H, " are not a multiple of the KV heads ", Hkv);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t t0, int64_t t1) {
    ferry_neon::decode_attention_tasks(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                                       tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<float>(), H,
                                       Hkv, D, bs, tables.size(1), scale, t0, t1, window);
  });
}
#endif

template <typename scalar_t>
static void decode_dispatch(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                            const torch::Tensor& tables, const torch::Tensor& lens, torch::Tensor& out, float scale,
                            int64_t window) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(2), bs = k_cache.size(1);
  const int64_t W = Hkv * D, slots = k_cache.size(0) * bs;
  auto run = [&](const auto& kr, const auto& vr) {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), kr, vr, tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                            out.data_ptr<scalar_t>(), B, H, Hkv, D, bs, tables.size(1), scale, window);
  };
  const auto cache_type = k_cache.scalar_type();
  if (cache_type == at::kChar) {
    auto ks = reinterpret_cast<const c10::Half*>(scales_ptr(k_cache, slots * Hkv * 2));
    auto vs = reinterpret_cast<const c10::Half*>(scales_ptr(v_cache, slots * Hkv * 2));
    run(Int8Rows{static_cast<const int8_t*>(k_cache.data_ptr()), ks, Hkv, D},
        Int8Rows{static_cast<const int8_t*>(v_cache.data_ptr()), vs, Hkv, D});
  } else if (is_fp8(cache_type)) {
    const float* table = cache_type == at::kFloat8_e4m3fn ? fp8_table<c10::Float8_e4m3fn>()
                                                         : fp8_table<c10::Float8_e5m2>();
    const float k_scale = *reinterpret_cast<const float*>(scales_ptr(k_cache, 4));
    const float v_scale = *reinterpret_cast<const float*>(scales_ptr(v_cache, 4));
    const bool e4m3 = cache_type == at::kFloat8_e4m3fn;
    run(Fp8Rows{static_cast<const uint8_t*>(k_cache.data_ptr()), table, k_scale, W, e4m3},
        Fp8Rows{static_cast<const uint8_t*>(v_cache.data_ptr()), table, v_scale, W, e4m3});
  } else {
    TORCH_CHECK(q.dtype() == k_cache.dtype(), "q and cache dtypes differ");
#if defined(__ARM_NEON) && !defined(FERRY_PORTABLE)
    if constexpr (std::is_same_v<scalar_t, float>)
      return decode_neon(q, k_cache, v_cache, tables, lens, out, scale, window);
#endif
    run(PlainRows<scalar_t>{k_cache.data_ptr<scalar_t>(), W}, PlainRows<scalar_t>{v_cache.data_ptr<scalar_t>(), W});
  }
}

// q: [B, H, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D] in q's dtype, or quantized (int8,
// fp8 e4m3 / e5m2, scales after the codes); block_tables: [B, max_blocks] int64; seq_lens: [B]
// int64; window: keys per sequence, its last ones (0: all). Returns [B, H, D].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                     int64_t window) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(k_cache.dtype() == v_cache.dtype(), "k and v cache dtypes differ");
  auto tables = block_tables.to(torch::kInt64).contiguous();
  auto lens = seq_lens.to(torch::kInt64).contiguous();
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
#if defined(FERRY_FASTPATH)
    if (fastpath::fast_dispatch<scalar_t>(q, k_cache, v_cache, tables, lens, out, static_cast<float>(scale), window))
      return;
#endif
    decode_dispatch<scalar_t>(q, k_cache, v_cache, tables, lens, out, static_cast<float>(scale), window);
  });
  return out;
}

// Quantize rows x [T, Hkv, D] into the slots of a quantized cache, as kv_quant.quantize does:
// int8 codes round(x / max(s, 1e-30)) with s = fp16(amax / 127) per row; fp8 codes of
// clamp(x / scale, -max, max), round to nearest even.
template <typename scalar_t>
static void write_quant(const torch::Tensor& x, torch::Tensor& cache, const int64_t* slots) {
  const int64_t T = x.size(0), Hkv = cache.size(2), D = cache.size(3);
  const int64_t num_slots = cache.size(0) * cache.size(1);
  const scalar_t* src = x.data_ptr<scalar_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot out of range");
  const auto cache_type = cache.scalar_type();
  if (cache_type == at::kChar) {
    int8_t* codes = static_cast<int8_t*>(cache.data_ptr());
    auto scales = reinterpret_cast<c10::Half*>(const_cast<uint8_t*>(scales_ptr(cache, num_slots * Hkv * 2)));
    at::parallel_for(0, T * Hkv, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t t = r / Hkv, h = r % Hkv, slot = slots[t];
        const scalar_t* row = src + r * D;
        float amax = 0.f;
        for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(static_cast<float>(row[d])));
        const c10::Half s16(amax / 127.f);
        const float s = std::max(static_cast<float>(s16), 1e-30f);
        scales[slot * Hkv + h] = s16;
        int8_t* dst = codes + (slot * Hkv + h) * D;
        for (int64_t d = 0; d < D; ++d)
          dst[d] = static_cast<int8_t>(std::clamp(std::nearbyint(static_cast<float>(row[d]) / s), -127.f, 127.f));
      }
    });
    return;
  }
  const float scale = *reinterpret_cast<const float*>(scales_ptr(cache, 4));
  const bool e4m3 = cache_type == at::kFloat8_e4m3fn;
  const float limit = e4m3 ? 448.f : 57344.f;
  uint8_t* codes = static_cast<uint8_t*>(cache.data_ptr());
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      uint8_t* dst = codes + slot * Hkv * D;
      const scalar_t* row = src + t * Hkv * D;
      for (int64_t i = 0; i < Hkv * D; ++i) {
        const float v = std::clamp(static_cast<float>(row[i]) / scale, -limit, limit);
        dst[i] = e4m3 ? c10::Float8_e4m3fn(v).x : c10::Float8_e5m2(v).x;
      }
    }
  });
}

void write_kv_quant_(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                     torch::Tensor slot_mapping) {
  TORCH_CHECK(k_cache.scalar_type() == at::kChar || is_fp8(k_cache.scalar_type()),
              "write_kv_quant_ needs an int8 or fp8 cache");
  TORCH_CHECK(k_cache.dtype() == v_cache.dtype(), "k and v cache dtypes differ");
  auto kc = k.contiguous(), vc = v.contiguous();
  auto slots = slot_mapping.to(torch::kInt64).contiguous();
  TORCH_CHECK(kc.size(0) == slots.size(0) && vc.size(0) == slots.size(0), "one slot per row");
  TORCH_CHECK(kc.size(1) == k_cache.size(2) && kc.size(2) == k_cache.size(3), "row shape differs from the cache's");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kc.scalar_type(), "write_kv_quant", [&] {
    write_quant<scalar_t>(kc, k_cache, slots.data_ptr<int64_t>());
    write_quant<scalar_t>(vc, v_cache, slots.data_ptr<int64_t>());
  });
}

void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void rope_qkv_(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin, int64_t heads,
               int64_t head_dim);

// Registered as torch ops (torch.ops.ferrylm.*), not pybind functions: torch.compile traces through
// them (a pybind call would split the compiled step into one graph per layer). Fake (meta) kernels
// are registered in Python (cpu_kernels.py). FRAGMENT: other extensions may add ops to "ferrylm".
TORCH_LIBRARY_FRAGMENT(FERRY_LIB, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale, int window=0) -> Tensor");
  m.def("write_kv_quant_(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rope_qkv_(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, int heads, int head_dim) -> ()");
}

TORCH_LIBRARY_IMPL(FERRY_LIB, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("write_kv_quant_", &write_kv_quant_);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("rope_qkv_", &rope_qkv_);
}
