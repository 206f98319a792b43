// A mixture-of-experts block's routed experts in one call: routing, grouping, every active expert's
// gate/up and down GEMVs with int8 activations, SiLU, and the weighted sum back to the tokens.
//
// Eager MoE (arch/moe.py's loop) runs ~8 torch ops per active expert: at 16 decode rows x top 4 of 32
// experts that was ~900 packed-GEMV calls and ~90 ms of Python, gathers and dispatch per step next to
// ~97 ms of kernels (bench/RESULTS.md, M3.4 MoE GGUF), where llama.cpp runs one op per layer. Here the
// experts of a layer are stacked (slot s's rows at s * rows): a thread takes 16 weight rows of one
// expert at a time, over that expert's token rows only, so the work splits across threads by weight
// bytes whatever the routing, and the output has a fixed shape, so a decode step with MoE layers traces
// into one compiled graph (compiled_step.py).
//
// The arithmetic is the per-expert loop's: the same int8 tiles (int8_tiles.h) on the same rows, x rounded
// to int8 per 32-element block per row as quant_linear_vnni does, and the intermediate values rounded to
// x's dtype where eager rounds them (gate/up outputs, silu, the product, the down output, the weighted sum
// added expert by expert in expert order): bit for bit in bf16; in fp32 exp (libm here, torch's own vector
// code there) may differ in its last bit (measured <= 3.6e-7 of the output, but a row whose activation
// that bit moves across an int8 rounding boundary moves by one code's worth: 6.7e-4). Routing is in fp32
// like transformers': softmax over all experts then top-k (optionally renormalised), or (Llama 4) top-k
// logits whose sigmoid scales the expert's input; ties go to the lower expert index.
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "int8_tiles.h"

namespace ferry_quant {

enum Routing : int64_t { SOFTMAX = 0, SOFTMAX_RENORM = 1, SIGMOID_INPUT = 2 };

#ifdef FERRY_INT8
namespace {

// Expert slot s of weights stacked slot after slot, `rows` output rows each.
Packed slot_view(const Packed& all, int64_t s, int64_t rows) {
  Packed w = all;
  const int64_t scale_bytes = all.f16 ? 2 : 4;
  w.codes = all.codes + s * rows * all.row_bytes;
  w.scales = static_cast<const char*>(all.scales) + s * rows * all.groups * scale_bytes;
  if (all.mins) w.mins = static_cast<const char*>(all.mins) + s * rows * all.groups * scale_bytes;
  w.rows = rows;
  return w;
}

// out[m * stride + (n - lo)] for weight rows n in [lo, hi) of w and every activation row of a (chunks of
// MAX_ROWS), as quant_linear_vnni computes them.
void rows_range(bool wide, bool q4, const Packed& w, const QuantizedActs& qa, int64_t m_begin, int64_t m_end,
                int64_t lo, int64_t hi, float* out, int64_t stride) {
  alignas(64) float buf[MAX_ROWS * 16];
  for (int64_t m0 = m_begin; m0 < m_end; m0 += MAX_ROWS) {
    const Acts rows = rows_of(qa, m0, std::min(MAX_ROWS, m_end - m0));
    tile_span(wide, q4, w, rows, lo, hi, buf);
    for (int64_t m = 0; m < rows.M; ++m)
      std::memcpy(out + (m0 - m_begin + m) * stride, buf + m * 16, (hi - lo) * sizeof(float));
  }
}

// Rounded to T's precision, as an eager op producing a T tensor rounds it.
template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

struct Route {
  std::vector<int64_t> token, offsets;  // pair p's token; slot s's pairs are [offsets[s], offsets[s + 1])
  std::vector<float> weight;            // pair p's routing weight, rounded to x's dtype
};

template <typename T>
Route route(const float* logits, int64_t num_tokens, int64_t E, int64_t k, int64_t routing, const int64_t* slots,
            int64_t num_slots) {
  std::vector<int64_t> chosen(num_tokens * k), per_slot(num_slots + 1, 0);
  std::vector<float> weight(num_tokens * k);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* l = logits + t * E;
    int64_t* c = chosen.data() + t * k;
    for (int64_t i = 0; i < k; ++i) {  // the i-th largest; ties to the lower index
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        bool taken = false;
        for (int64_t j = 0; j < i; ++j) taken |= c[j] == e;
        if (!taken && (best < 0 || l[e] > l[best])) best = e;
      }
      c[i] = best;
    }
    float* w = weight.data() + t * k;
    if (routing == SIGMOID_INPUT) {
      for (int64_t i = 0; i < k; ++i) w[i] = 1.f / (1.f + std::exp(-l[c[i]]));
    } else {
      const float mx = l[c[0]];
      float sum = 0.f;
      for (int64_t e = 0; e < E; ++e) sum += std::exp(l[e] - mx);
      float chosen_sum = 0.f;
      for (int64_t i = 0; i < k; ++i) chosen_sum += (w[i] = std::exp(l[c[i]] - mx) / sum);
      if (routing == SOFTMAX_RENORM)
        for (int64_t i = 0; i < k; ++i) w[i] /= chosen_sum;
    }
    for (int64_t i = 0; i < k; ++i) {
      w[i] = round_to<T>(w[i]);
      if (slots[c[i]] >= 0) ++per_slot[slots[c[i]] + 1];
    }
  }
  Route r;
  r.offsets.assign(num_slots + 1, 0);
  for (int64_t s = 0; s < num_slots; ++s) r.offsets[s + 1] = r.offsets[s] + per_slot[s + 1];
  r.token.resize(r.offsets[num_slots]);
  r.weight.resize(r.offsets[num_slots]);
  std::vector<int64_t> fill(r.offsets.begin(), r.offsets.end() - 1);
  for (int64_t t = 0; t < num_tokens; ++t)  // counting sort by slot, token order kept within a slot
    for (int64_t i = 0; i < k; ++i)
      if (const int64_t s = slots[chosen[t * k + i]]; s >= 0) {
        r.token[fill[s]] = t;
        r.weight[fill[s]++] = weight[t * k + i];
      }
  return r;
}

}  // namespace
#endif

bool moe_experts_available() {
#ifdef FERRY_INT8
  return true;
#else
  return false;
#endif
}

// out [T, H] (x's dtype) = sum over each token's top-k experts that are local (slots[e] >= 0) of its
// routing weight times down(silu(gate(x)) * up(x)) (Llama 4: down(silu(gate(x w)) * up(x w))). gate_up
// stacks each local expert's [gate; up] rows ([S * 2I, H]), down its [H, I] rows ([S * H, I]), packed.
torch::Tensor moe_experts_int8(const torch::Tensor& x, const torch::Tensor& logits, int64_t top_k, int64_t routing,
                               const torch::Tensor& slots, const torch::Tensor& gu_codes, const torch::Tensor& gu_scales,
                               const c10::optional<torch::Tensor>& gu_mins, int64_t gu_group, bool gu_q4,
                               const torch::Tensor& d_codes, const torch::Tensor& d_scales,
                               const c10::optional<torch::Tensor>& d_mins, int64_t d_group, bool d_q4) {
  TORCH_CHECK(x.dim() == 2 && logits.dim() == 2 && logits.size(0) == x.size(0), "x: [T, H], logits: [T, E]");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == logits.size(1) && slots.scalar_type() == at::kLong,
              "slots: int64 [E]");
  TORCH_CHECK(routing >= SOFTMAX && routing <= SIGMOID_INPUT, "routing: 0, 1 or 2");
  const int64_t T = x.size(0), H = x.size(1), E = logits.size(1);
  TORCH_CHECK(top_k >= 1 && top_k <= E, "top_k ", top_k, " of ", E, " experts");
  const int64_t I = d_q4 ? 2 * d_codes.size(1) : d_codes.size(1);
  TORCH_CHECK(I > 0 && gu_codes.size(0) % (2 * I) == 0, "gate_up rows are not a multiple of 2 x ", I);
  const int64_t S = gu_codes.size(0) / (2 * I);
  TORCH_CHECK(d_codes.size(0) == S * H, "down: ", S, " experts of ", H, " rows expected");
  check(gu_codes, gu_scales, gu_mins, H, gu_group, gu_q4);
  check(d_codes, d_scales, d_mins, I, d_group, d_q4);
  const torch::Tensor slots_c = slots.contiguous();
  const int64_t* slot_of = slots_c.data_ptr<int64_t>();
  for (int64_t e = 0; e < E; ++e) TORCH_CHECK(slot_of[e] < S, "slots[", e, "] = ", slot_of[e], " past ", S, " experts");
  torch::Tensor out = at::empty({T, H}, x.options());  // zeroed below: at::zeros is one more dispatched op
  std::memset(out.data_ptr(), 0, out.nbytes());
#ifdef FERRY_INT8
  if (T == 0) return out;
  const bool wide = use_zmm();
  const Packed gu = describe(gu_codes, gu_scales, gu_mins, gu_group), dn = describe(d_codes, d_scales, d_mins, d_group);
  const std::vector<float> xf = widened(x), lf = widened(logits);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "moe_experts_int8", [&] {
    const Route r = route<scalar_t>(lf.data(), T, E, top_k, routing, slot_of, S);
    const int64_t P = r.offsets[S];
    if (P == 0) return;
    // each pair's input row (Llama 4: scaled by its weight, in x's dtype), quantized per 32 elements
    std::vector<float> xp(P * H);
    const float* xs = xf.data();
    for (int64_t p = 0; p < P; ++p)
      for (int64_t h = 0; h < H; ++h) {
        const float v = xs[r.token[p] * H + h];
        xp[p * H + h] = routing == SIGMOID_INPUT ? round_to<scalar_t>(v * r.weight[p]) : v;
      }
    const QuantizedActs qa = quantize_acts(xp.data(), P, H, gu_group, gu_q4, wide);
    constexpr int64_t TILE = 16;
    std::vector<int64_t> active;  // the slots that have pairs
    for (int64_t s = 0; s < S; ++s)
      if (r.offsets[s + 1] > r.offsets[s]) active.push_back(s);
    std::vector<float> act(P * I), y(P * H);
    // act = silu(gate) * up for gate/up rows [lo, lo + width) of slot s, every pair of the slot (g, u: scratch
    // of MAX_ROWS x width). The gate rows are computed TILE at a time, then the up rows: with width = I they
    // are two long runs through memory. 16-row steps alternating between gate and up took 10% longer an MoE
    // layer from DRAM (1 row, 2 threads, 6.7 MB a layer: 328 vs 295 us, bench/RESULTS.md).
    auto gate_up_tile = [&](int64_t s, int64_t lo, int64_t width, float* g, float* u) {
      const int64_t hi = std::min(I, lo + width), m0 = r.offsets[s], m1 = r.offsets[s + 1];
      const Packed w = slot_view(gu, s, 2 * I);
      for (int64_t c = m0; c < m1; c += MAX_ROWS) {
        const int64_t c1 = std::min(m1, c + MAX_ROWS);
        for (int64_t sub = lo; sub < hi; sub += TILE)
          rows_range(wide, gu_q4, w, qa, c, c1, sub, std::min(hi, sub + TILE), g + (sub - lo), width);
        for (int64_t sub = lo; sub < hi; sub += TILE)
          rows_range(wide, gu_q4, w, qa, c, c1, I + sub, I + std::min(hi, sub + TILE), u + (sub - lo), width);
        for (int64_t m = 0; m < c1 - c; ++m)
          for (int64_t j = 0; j < hi - lo; ++j) {
            const float gv = round_to<scalar_t>(g[m * width + j]), uv = round_to<scalar_t>(u[m * width + j]);
            const float silu = round_to<scalar_t>(gv / (1.f + std::exp(-gv)));
            act[(c + m) * I + lo + j] = round_to<scalar_t>(silu * uv);
          }
      }
    };
    // y for down rows [lo, lo + TILE) of slot s from its pairs' quantized act (q's row 0 is pair q0)
    auto down_tile = [&](int64_t s, int64_t lo, const QuantizedActs& q, int64_t q0) {
      rows_range(wide, d_q4, slot_view(dn, s, H), q, r.offsets[s] - q0, r.offsets[s + 1] - q0, lo,
                 std::min(H, lo + TILE), y.data() + r.offsets[s] * H + lo, H);
    };
    const int64_t threads = at::get_num_threads(), n = static_cast<int64_t>(active.size());
    if (n >= threads && (n % threads == 0 || n >= 4 * threads)) {
      // whole experts per thread (a decode row's top k over the threads): gate/up, act and down of an
      // expert with no barrier between them, one parallel region a layer instead of three. Measured on
      // the MoE GGUF bench model (2 threads, medians of 6 / 4 alternating runs): 14.9 vs 16.3 ms a token
      // at 1 stream, 109 vs 115 ms a step at 16.
      at::parallel_for(0, n, 1, [&](int64_t i0, int64_t i1) {
        std::unique_ptr<float[]> g(new float[MAX_ROWS * I]), u(new float[MAX_ROWS * I]);
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t s = active[i], m0 = r.offsets[s];
          // an expert's gate and up rows in two runs while its pairs fit one chunk of activation rows; with
          // more, TILE rows at a time so that each weight tile stays in L1 while every chunk passes over it
          const int64_t width = r.offsets[s + 1] - m0 <= MAX_ROWS ? I : TILE;
          for (int64_t lo = 0; lo < I; lo += width) gate_up_tile(s, lo, width, g.get(), u.get());
          const QuantizedActs q = quantize_acts(act.data() + m0 * I, r.offsets[s + 1] - m0, I, d_group, d_q4, wide);
          for (int64_t lo = 0; lo < H; lo += TILE) down_tile(s, lo, q, m0);
        }
      });
    } else {
      // fewer experts than threads (or a split that would leave one idle): 16 rows of one expert an item
      std::vector<std::pair<int64_t, int64_t>> items;
      for (const int64_t s : active)
        for (int64_t lo = 0; lo < I; lo += TILE) items.emplace_back(s, lo);
      at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
        std::vector<float> g(MAX_ROWS * TILE), u(MAX_ROWS * TILE);
        for (int64_t i = i0; i < i1; ++i) gate_up_tile(items[i].first, items[i].second, TILE, g.data(), u.data());
      });
      const QuantizedActs qd = quantize_acts(act.data(), P, I, d_group, d_q4, wide);
      items.clear();
      for (const int64_t s : active)
        for (int64_t lo = 0; lo < H; lo += TILE) items.emplace_back(s, lo);
      at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) down_tile(items[i].first, items[i].second, qd, 0);
      });
    }
    // out[t] += w * y, pair by pair in expert order (index_add_ expert after expert), each step rounded
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, H, std::max<int64_t>(256, 65536 / P), [&](int64_t h0, int64_t h1) {  // small: inline
      for (int64_t p = 0; p < P; ++p) {
        scalar_t* row = o + r.token[p] * H;
        const float* yp = y.data() + p * H;
        const float wp = r.weight[p];
        for (int64_t h = h0; h < h1; ++h) {
          const float v = routing == SIGMOID_INPUT ? round_to<scalar_t>(yp[h])
                                                   : round_to<scalar_t>(round_to<scalar_t>(yp[h]) * wp);
          row[h] = static_cast<scalar_t>(static_cast<float>(row[h]) + v);
        }
      }
    });
  });
  return out;
#else
  TORCH_CHECK(false, "moe_experts_int8: built without int8 dot products (AVX2 or AVX512-VNNI)");
#endif
}

}  // namespace ferry_quant

TORCH_LIBRARY_FRAGMENT(FERRY_LIB, m) {
  m.def("quant_moe_experts_int8(Tensor x, Tensor logits, int top_k, int routing, Tensor slots, Tensor gu_codes, "
        "Tensor gu_scales, Tensor? gu_mins, int gu_group, bool gu_q4, Tensor d_codes, Tensor d_scales, "
        "Tensor? d_mins, int d_group, bool d_q4) -> Tensor");
  m.def("quant_has_moe_experts() -> bool", &ferry_quant::moe_experts_available);
}

TORCH_LIBRARY_IMPL(FERRY_LIB, CPU, m) { m.impl("quant_moe_experts_int8", &ferry_quant::moe_experts_int8); }
