// Fused elementwise ops for the CPU decode step, where each separate torch op costs more in
// dispatch than in arithmetic at small batch sizes. Both reproduce the reference's rounding:
// compute in fp32, round to the activation dtype where the reference rounds. Vectorised for fp32
// and bf16 with AVX2 + FMA (every x86 variant above portable) and for bf16 with AVX512BF16; the
// portable build and other dtypes run the generic loops.
#include "../../csrc/torch_lite.h"
#include <ATen/Parallel.h>
#include <cmath>

template <typename scalar_t>
static void add_rms_norm_kernel(scalar_t* x, scalar_t* residual, const scalar_t* w, int64_t T, int64_t D,
                                float eps) {
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      scalar_t* xr = x + t * D;
      scalar_t* rr = residual + t * D;
      float lanes[16] = {0.f};
      for (int64_t d = 0; d < D; ++d) {
        const scalar_t s = static_cast<scalar_t>(static_cast<float>(xr[d]) + static_cast<float>(rr[d]));
        rr[d] = s;
        const float f = static_cast<float>(s);
        lanes[d & 15] += f * f;
      }
      float sum = 0.f;
      for (int j = 0; j < 16; ++j) sum += lanes[j];
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(D) + eps);
      for (int64_t d = 0; d < D; ++d) {
        const scalar_t normed = static_cast<scalar_t>(static_cast<float>(rr[d]) * inv);
        xr[d] = static_cast<scalar_t>(static_cast<float>(w[d]) * static_cast<float>(normed));
      }
    }
  });
}

#if defined(__AVX512BF16__)
#include <immintrin.h>
// bf16 rows with D % 16 == 0, vectorised: the generic loop above converts one element at a time
// through c10's scalar rounding (~330 us for a 500-token prefill chunk of SmolLM2, x60 per step).
// Same rounding points (bf16 sum, bf16 normed value, bf16 product; vcvtneps2bf16 rounds to nearest
// even like c10); the sum of squares is added in another order, so the result may differ from the
// generic loop by an fp32 ulp of the norm (tests/unit/test_cpu_fused_ops.py bounds it).
static inline __m512 bf16_to_f32(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
static inline __m256i f32_to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

static void add_rms_norm_bf16(c10::BFloat16* x, c10::BFloat16* residual, const c10::BFloat16* w, int64_t T,
                              int64_t D, float eps) {
  at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      c10::BFloat16* xr = x + t * D;
      c10::BFloat16* rr = residual + t * D;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) {
        const __m256i sb = f32_to_bf16(_mm512_add_ps(bf16_to_f32(xr + d), bf16_to_f32(rr + d)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(rr + d), sb);
        const __m512 f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(sb), 16));
        acc = _mm512_add_ps(acc, _mm512_mul_ps(f, f));
      }
      const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(D) + eps));
      for (int64_t d = 0; d < D; d += 16) {
        const __m256i normed = f32_to_bf16(_mm512_mul_ps(bf16_to_f32(rr + d), inv));
        const __m512 nf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(normed), 16));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xr + d), f32_to_bf16(_mm512_mul_ps(bf16_to_f32(w + d), nf)));
      }
    }
  });
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
// fp32 and bf16 rows on 8 lanes, any D (a scalar tail). AVX-512 builds run them too: for fp32, and
// for bf16 where AVX512BF16 is missing or D % 16 != 0. The generic loops' rounding points are kept,
// so the results are torch's: bf16 is narrowed with c10's round-to-nearest-even (bit tricks, not a
// conversion instruction), and a product the reference rounds on its own is passed through rounded(),
// which stops -ffast-math fusing it into an FMA (one rounding where torch has two) or reassociating it.
namespace avx2 {

static inline __m256 rounded(__m256 v) {
  asm("" : "+x"(v));
  return v;
}
static inline float rounded(float v) {
  asm("" : "+x"(v));
  return v;
}

static inline __m256 widen(__m128i bf16) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16), 16));
}

// c10::BFloat16(float) on 8 lanes: round_to_nearest_even's bias (0x7FFF plus the kept lsb), NaN 0x7FC0.
static inline __m128i narrow(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

static inline __m256 load(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load(const c10::BFloat16* p) {
  return widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Stores v as T and returns what was stored, widened back to fp32.
static inline __m256 store(float* p, __m256 v) {
  v = rounded(v);
  _mm256_storeu_ps(p, v);
  return v;
}
static inline __m256 store(c10::BFloat16* p, __m256 v) {
  const __m128i b = narrow(v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), b);
  return widen(b);
}

// v rounded to T, widened back: the value a T holds.
template <typename T>
static inline __m256 as(__m256 v) { return rounded(v); }
template <>
inline __m256 as<c10::BFloat16>(__m256 v) { return widen(narrow(v)); }

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// One row of add_rms_norm_kernel: the same rounding points, the sum of squares in another order.
template <typename T>
static void add_rms_norm_row(T* xr, T* rr, const T* w, int64_t D, float eps) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();  // one FMA chain would wait on its latency
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    const __m256 s0 = store(rr + d, _mm256_add_ps(load(xr + d), load(rr + d)));
    const __m256 s1 = store(rr + d + 8, _mm256_add_ps(load(xr + d + 8), load(rr + d + 8)));
    acc0 = _mm256_fmadd_ps(s0, s0, acc0);
    acc1 = _mm256_fmadd_ps(s1, s1, acc1);
  }
  if (d + 8 <= D) {
    const __m256 s = store(rr + d, _mm256_add_ps(load(xr + d), load(rr + d)));
    acc0 = _mm256_fmadd_ps(s, s, acc0);
    d += 8;
  }
  float sum = hsum(_mm256_add_ps(acc0, acc1));
  for (int64_t e = d; e < D; ++e) {
    rr[e] = static_cast<T>(static_cast<float>(xr[e]) + static_cast<float>(rr[e]));
    sum += static_cast<float>(rr[e]) * static_cast<float>(rr[e]);
  }
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(D) + eps);
  const __m256 iv = _mm256_set1_ps(inv);
  for (d = 0; d + 8 <= D; d += 8) store(xr + d, _mm256_mul_ps(load(w + d), as<T>(_mm256_mul_ps(load(rr + d), iv))));
  for (; d < D; ++d) {
    const T normed = static_cast<T>(rounded(static_cast<float>(rr[d]) * inv));
    xr[d] = static_cast<T>(static_cast<float>(w[d]) * static_cast<float>(normed));
  }
}

template <typename T>
static void add_rms_norm_rows(T* x, T* residual, const T* w, int64_t rows, int64_t D, float eps) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) add_rms_norm_row(x + t * D, residual + t * D, w, D, eps);
  });
}

// One head of rope_kernel: each product rounded, then the difference / sum, as torch computes it.
template <typename T>
static void rope_head(T* x, const float* c, const float* s, int64_t half) {
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    const __m256 x1 = load(x + i), x2 = load(x + i + half), cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(s + i);
    store(x + i, _mm256_sub_ps(rounded(_mm256_mul_ps(x1, cv)), rounded(_mm256_mul_ps(x2, sv))));
    store(x + i + half, _mm256_add_ps(rounded(_mm256_mul_ps(x2, cv)), rounded(_mm256_mul_ps(x1, sv))));
  }
  for (; i < half; ++i) {
    const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
    x[i] = static_cast<T>(rounded(x1 * c[i]) - rounded(x2 * s[i]));
    x[i + half] = static_cast<T>(rounded(x2 * c[i]) + rounded(x1 * s[i]));
  }
}

template <typename T>
static void rope_rows(T* qkv, const int64_t* pos, const float* cos, const float* sin, int64_t rows,
                      int64_t row_stride, int64_t heads, int64_t D) {
  const int64_t half = D / 2;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h)
        rope_head(qkv + t * row_stride + h * D, cos + pos[t] * half, sin + pos[t] * half, half);
  });
}

}  // namespace avx2
#endif

// x <- rms_norm(x + residual) * w ; residual <- x + residual. Both [T, D] contiguous, in place.
void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous(), "contiguous inputs only");
  const int64_t D = x.size(-1), T = x.numel() / D;
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 && D % 16 == 0) {
    add_rms_norm_bf16(x.data_ptr<c10::BFloat16>(), residual.data_ptr<c10::BFloat16>(),
                      weight.data_ptr<c10::BFloat16>(), T, D, static_cast<float>(eps));
    return;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (weight.scalar_type() == x.scalar_type() && x.scalar_type() == at::kFloat) {
    avx2::add_rms_norm_rows(x.data_ptr<float>(), residual.data_ptr<float>(), weight.data_ptr<float>(), T, D,
                            static_cast<float>(eps));
    return;
  }
  if (weight.scalar_type() == x.scalar_type() && x.scalar_type() == at::kBFloat16) {
    avx2::add_rms_norm_rows(x.data_ptr<c10::BFloat16>(), residual.data_ptr<c10::BFloat16>(),
                            weight.data_ptr<c10::BFloat16>(), T, D, static_cast<float>(eps));
    return;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_kernel<scalar_t>(x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(),
                                  weight.data_ptr<scalar_t>(), T, D, static_cast<float>(eps));
  });
}

template <typename scalar_t>
static void rope_kernel(scalar_t* qkv, const int64_t* pos, const float* cos, const float* sin, int64_t T,
                        int64_t row_stride, int64_t heads, int64_t D) {
  const int64_t half = D / 2;
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + pos[t] * half;
      const float* s = sin + pos[t] * half;
      for (int64_t h = 0; h < heads; ++h) {
        scalar_t* x = qkv + t * row_stride + h * D;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
          x[i] = static_cast<scalar_t>(x1 * c[i] - x2 * s[i]);
          x[i + half] = static_cast<scalar_t>(x2 * c[i] + x1 * s[i]);
        }
      }
    }
  });
}

// Rotate-half RoPE in place on the first `heads` heads of each row of qkv [T, row] (q heads then
// k heads, as packed by the QKV projection). cos/sin: [max_pos, D/2] fp32.
void rope_qkv_(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin, int64_t heads,
               int64_t head_dim) {
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(), "contiguous inputs only");
  auto pos = positions.to(torch::kInt64).contiguous();
#if defined(__AVX2__) && defined(__FMA__)
  if (qkv.scalar_type() == at::kFloat) {
    avx2::rope_rows(qkv.data_ptr<float>(), pos.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                    qkv.size(0), qkv.size(1), heads, head_dim);
    return;
  }
  if (qkv.scalar_type() == at::kBFloat16) {
    avx2::rope_rows(qkv.data_ptr<c10::BFloat16>(), pos.data_ptr<int64_t>(), cos.data_ptr<float>(),
                    sin.data_ptr<float>(), qkv.size(0), qkv.size(1), heads, head_dim);
    return;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_qkv", [&] {
    rope_kernel<scalar_t>(qkv.data_ptr<scalar_t>(), pos.data_ptr<int64_t>(), cos.data_ptr<float>(),
                          sin.data_ptr<float>(), qkv.size(0), qkv.size(1), heads, head_dim);
  });
}
