// Paged decode attention for the CPU: one query token per sequence, K/V read in place through
// the block table (no gather copy). Parallel over (sequence, KV head); each task serves the
// whole query group of its KV head, so every K/V row is read once. Scores and softmax in fp32.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

template <typename T>
static inline float to_f(T x) { return static_cast<float>(x); }

// Dot product with 16 independent lanes so the compiler vectorises it without -ffast-math.
static inline float dot(const float* a, const float* b, int64_t n) {
  float lanes[16] = {0.f};
  int64_t d = 0;
  for (; d + 16 <= n; d += 16)
    for (int j = 0; j < 16; ++j) lanes[j] += a[d + j] * b[d + j];
  float s = 0.f;
  for (int j = 0; j < 16; ++j) s += lanes[j];
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

template <typename scalar_t>
static void decode_kernel(const scalar_t* q, const scalar_t* kc, const scalar_t* vc, const int64_t* tables,
                          const int64_t* seq_lens, scalar_t* out, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                          int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t G = H / Hkv;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv;
      const int64_t S = seq_lens[b];
      const int64_t* table = tables + b * max_blocks;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_f(q[(b * H + h * G + g) * D + d]) * scale;
      scores.assign(G * S, 0.f);
      for (int64_t t = 0; t < S; ++t) {
        const scalar_t* k = kc + ((table[t / block_size] * block_size + t % block_size) * Hkv + h) * D;
        float kf[256];
        for (int64_t d = 0; d < D; ++d) kf[d] = to_f(k[d]);
        for (int64_t g = 0; g < G; ++g) scores[g * S + t] = dot(qf.data() + g * D, kf, D);
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * S;
        float m = -INFINITY;
        for (int64_t t = 0; t < S; ++t) m = std::max(m, sg[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < S; ++t) { sg[t] = std::exp(sg[t] - m); sum += sg[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < S; ++t) sg[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < S; ++t) {
        const scalar_t* v = vc + ((table[t / block_size] * block_size + t % block_size) * Hkv + h) * D;
        float vf[256];
        for (int64_t d = 0; d < D; ++d) vf[d] = to_f(v[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * S + t];
          float* ag = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) ag[d] += p * vf[d];
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) out[(b * H + h * G + g) * D + d] = static_cast<scalar_t>(acc[g * D + d]);
    }
  });
}

// q: [B, H, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; block_tables: [B, max_blocks] int64;
// seq_lens: [B] int64. Returns [B, H, D].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(q.dtype() == k_cache.dtype(), "q and cache dtypes differ");
  TORCH_CHECK(q.size(2) <= 256, "head_dim > 256 not supported");
  auto tables = block_tables.to(torch::kInt64).contiguous();
  auto lens = seq_lens.to(torch::kInt64).contiguous();
  auto out = torch::empty_like(q);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(2), bs = k_cache.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), B, H,
                            Hkv, D, bs, tables.size(1), static_cast<float>(scale));
  });
  return out;
}

void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void rope_qkv_(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin, int64_t heads,
               int64_t head_dim);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU)");
  m.def("add_rms_norm_", &add_rms_norm_, "In-place fused residual add + RMSNorm (CPU)");
  m.def("rope_qkv_", &rope_qkv_, "In-place rotate-half RoPE on packed q/k heads (CPU)");
}
