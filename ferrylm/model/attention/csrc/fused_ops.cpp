// Fused elementwise ops for the CPU decode step, where each separate torch op costs more in
// dispatch than in arithmetic at small batch sizes. Both reproduce the reference's rounding:
// compute in fp32, round to the activation dtype where the reference rounds.
#include <torch/extension.h>
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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_qkv", [&] {
    rope_kernel<scalar_t>(qkv.data_ptr<scalar_t>(), pos.data_ptr<int64_t>(), cos.data_ptr<float>(),
                          sin.data_ptr<float>(), qkv.size(0), qkv.size(1), heads, head_dim);
  });
}
