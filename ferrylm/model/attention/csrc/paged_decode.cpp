// Paged decode attention for the CPU: one query token per sequence, K/V read in place through
// the block table (no gather copy). Parallel over (sequence, KV head); each task serves the
// whole query group of its KV head, so every K/V row is read once. Scores and softmax in fp32.
#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <math.h>
#include <vector>

template <typename T>
static inline float to_f(T x) { return static_cast<float>(x); }

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
  // One task per sequence: a cache row [Hkv, D] is contiguous, so reading all KV heads of a token
  // together uses every byte of each cache line (per-head tasks read a third of each line).
  const int64_t G = H / Hkv, W = Hkv * D;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(H * D), acc(H * D), scores, row(W);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t S = seq_lens[b];
      const int64_t* table = tables + b * max_blocks;
      load_row(q + b * H * D, qf.data(), H * D);
      for (int64_t i = 0; i < H * D; ++i) qf[i] *= scale;
      scores.resize(H * S);
      for (int64_t t = 0; t < S; ++t) {
        load_row(kc + (table[t / block_size] * block_size + t % block_size) * W, row.data(), W);
        for (int64_t h = 0; h < H; ++h) scores[h * S + t] = dot(qf.data() + h * D, row.data() + (h / G) * D, D);
      }
      for (int64_t h = 0; h < H; ++h) {
        float* sh = scores.data() + h * S;
        float m = -INFINITY;
        for (int64_t t = 0; t < S; ++t) m = std::max(m, sh[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < S; ++t) { sh[t] = expf(sh[t] - m); sum += sh[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < S; ++t) sh[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < S; ++t) {
        load_row(vc + (table[t / block_size] * block_size + t % block_size) * W, row.data(), W);
        for (int64_t h = 0; h < H; ++h) {
          const float p = scores[h * S + t];
          const float* vh = row.data() + (h / G) * D;
          float* ah = acc.data() + h * D;
          for (int64_t d = 0; d < D; ++d) ah[d] += p * vh[d];
        }
      }
      for (int64_t i = 0; i < H * D; ++i) out[b * H * D + i] = static_cast<scalar_t>(acc[i]);
    }
  });
}

// q: [B, H, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; block_tables: [B, max_blocks] int64;
// seq_lens: [B] int64. Returns [B, H, D].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(q.dtype() == k_cache.dtype(), "q and cache dtypes differ");
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

// Registered as torch ops (torch.ops.ferrylm.*), not pybind functions: torch.compile traces through
// them (a pybind call would split the compiled step into one graph per layer). Fake (meta) kernels
// are registered in Python (cpu_kernels.py). FRAGMENT: other extensions may add ops to "ferrylm".
TORCH_LIBRARY_FRAGMENT(ferrylm, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rope_qkv_(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, int heads, int head_dim) -> ()");
}

TORCH_LIBRARY_IMPL(ferrylm, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("rope_qkv_", &rope_qkv_);
}
