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

// x <- rms_norm(x + residual) * w ; residual <- x + residual. Both [T, D] contiguous, in place.
void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous(), "contiguous inputs only");
  const int64_t D = x.size(-1), T = x.numel() / D;
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
