// The ARM NEON kernels (quant/csrc/neon_gemv.h, attention/csrc/neon_decode.h) against scalar references
// written here, without torch: tests/unit/test_neon_qemu.py cross-compiles this file for aarch64 (with
// and without the dot-product extension) and runs it under qemu-user.
//
// Checked: the int8 quantization of activations bit for bit (codes, block scales; ties to even); the
// GEMV (q4 with and without mins, q8 with and without, groups 16 (q8) / 32 / 64 / 128, fp16 and fp32
// scales, M = 1..4, N odd and even, odd block counts and rows past one 64-block chunk) against the
// dequantized weights times the rounded activations in float64; exp4 / dot / axpy / softmax_; paged
// decode attention (head dims 64 / 128, and 80 / 36 for the fallback loops; GQA groups 1, 3 and 5;
// sequence lengths 1 / 17 / 300 and 0; block size 16; shuffled block tables, unused slots NaN)
// against a float64 reference. Prints each failure, then PASS / FAIL counts; exits 1 on any failure.
#include "../../ferrylm/model/attention/csrc/neon_decode.h"
#include "../../ferrylm/model/quant/csrc/neon_gemv.h"

#if !defined(FERRY_NEON_GEMV) || !defined(FERRY_NEON_DECODE)
#error "build for aarch64 with NEON (and without FERRY_PORTABLE): the kernels under test are compiled out"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace {

struct Tally {
  int pass = 0, fail = 0;
  double worst_gemv = 0, worst_decode = 0, worst_exp = 0;  // the largest error ratios seen
  void check(bool ok, const std::string& what) {
    if (ok) {
      ++pass;
      return;
    }
    if (++fail <= 40) std::printf("FAIL %s\n", what.c_str());
  }
};

// IEEE fp16 bits to float, subnormals included (the reference's own conversion, not the kernel's).
float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  float v;
  if (exp == 0) {
    v = std::ldexp(static_cast<float>(man), -24);
  } else if (exp == 31) {
    v = man ? NAN : INFINITY;
  } else {
    const uint32_t bits = ((exp - 15 + 127) << 23) | (man << 13);
    std::memcpy(&v, &bits, 4);
  }
  return sign ? -v : v;
}

// A random fp16 with exponent field in [e0, e1] (value in [2^(e0-15), 2^(e1-14))) and the given sign.
uint16_t random_half(std::mt19937& rng, int e0, int e1, bool negative) {
  const int e = std::uniform_int_distribution<int>(e0, e1)(rng);
  const int man = std::uniform_int_distribution<int>(0, 1023)(rng);
  return static_cast<uint16_t>((negative ? 0x8000 : 0) | (e << 10) | man);
}

// ---------------------------------------------------------------- int8 activations and the GEMV

// The reference rounding of one 32-element block (vnni_gemv.cpp's arithmetic): codes, returns d.
float ref_quantize_block(const float* x, int* code) {
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int i = 0; i < 32; ++i) code[i] = static_cast<int>(std::nearbyint(x[i] * inv));
  return amax / 127.f;
}

void check_ties(Tally& t) {
  // amax 127 makes the factor exactly 1, so x.5 values are ties: they round to the even neighbour.
  float x[32] = {127.f, 0.5f, 1.5f, 2.5f, -0.5f, -1.5f, -2.5f, 126.5f, -126.5f, 3.49f, -3.51f};
  const int want[11] = {127, 0, 2, 2, 0, -2, -2, 126, -126, 3, -4};
  int8_t q[32];
  int32_t sums[2];
  const float amax = ferry_neon::quantize_block(x, q, sums);
  bool ok = amax == 127.f && sums[1] == 0;
  int s0 = 0;
  for (int i = 0; i < 11; ++i) ok = ok && q[i] == want[i], s0 += want[i];
  t.check(ok && sums[0] == s0, "quantize_block: ties to even, sums");
  float zero[32] = {0.f};
  const float za = ferry_neon::quantize_block(zero, q, sums);
  t.check(za == 0.f && sums[0] == 0 && sums[1] == 0 && std::all_of(q, q + 32, [](int8_t v) { return v == 0; }),
          "quantize_block: an all-zero block");
}

struct GemvCase {
  bool q4, mins, f16;
  int64_t G, K, N, M;
  std::string name() const {
    char buf[160];
    std::snprintf(buf, sizeof buf, "gemv %s%s %s G=%ld K=%ld N=%ld M=%ld", q4 ? "q4" : "q8", mins ? "+mins" : "",
                  f16 ? "fp16" : "fp32", (long)G, (long)K, (long)N, (long)M);
    return buf;
  }
};

// Activations with blocks of very different magnitudes, a zero block and single outliers.
std::vector<float> make_acts(std::mt19937& rng, int64_t M, int64_t K) {
  std::uniform_real_distribution<float> u(-1.f, 1.f), mag(0.01f, 8.f);
  std::vector<float> x(M * K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < K / 32; ++b) {
      const float s = (b == 1 && m == 0) ? 0.f : mag(rng);
      for (int i = 0; i < 32; ++i) x[m * K + 32 * b + i] = s * u(rng);
      if (b % 5 == 2) x[m * K + 32 * b + (b % 32)] = 20.f * s;
    }
  return x;
}

struct Weights {
  std::vector<uint8_t> codes;
  std::vector<uint16_t> s16, m16;
  std::vector<float> s32, m32;
  ferry_neon::PackedWeights view;
  float scale(int64_t i) const { return view.f16 ? half_to_float(s16[i]) : s32[i]; }
  float min(int64_t i) const { return !view.mins ? 0.f : view.f16 ? half_to_float(m16[i]) : m32[i]; }
  int code(int64_t n, int64_t k) const {  // packed.h's layout, read element by element
    if (!view.q4) return static_cast<int8_t>(codes[n * view.row_bytes + k]);
    const uint8_t byte = codes[n * view.row_bytes + (k / 32) * 16 + k % 16];
    return (k % 32) < 16 ? (byte & 0xF) : (byte >> 4);
  }
};

Weights make_weights(std::mt19937& rng, const GemvCase& c) {
  Weights w;
  const int64_t groups = c.K / c.G, row_bytes = c.q4 ? c.K / 2 : c.K;
  std::uniform_int_distribution<int> byte(0, 255);
  w.codes.resize(c.N * row_bytes);
  for (auto& b : w.codes) b = static_cast<uint8_t>(byte(rng));
  std::uniform_real_distribution<float> sc(0.002f, 0.05f);
  for (int64_t i = 0; i < c.N * groups; ++i) {
    w.s16.push_back(random_half(rng, 6, 10, false));  // 2^-9 .. 2^-4
    w.m16.push_back(random_half(rng, 9, 13, true));   // about -8 scales (Q4_1-like)
    w.s32.push_back(sc(rng));
    w.m32.push_back(-8.f * sc(rng));
  }
  const void* scales = c.f16 ? static_cast<const void*>(w.s16.data()) : w.s32.data();
  const void* mins = !c.mins ? nullptr : c.f16 ? static_cast<const void*>(w.m16.data()) : w.m32.data();
  w.view = {w.codes.data(), row_bytes, scales, mins, groups, c.G, c.f16, c.q4};
  return w;
}

// Activation quantization must be the reference's bit for bit (codes and block scales).
bool acts_match(const ferry_neon::Int8Acts& a, const std::vector<float>& x, const GemvCase& c,
                std::vector<double>& xr) {
  bool ok = true;
  xr.assign(c.M * c.K, 0.0);
  for (int64_t m = 0; m < c.M; ++m)
    for (int64_t b = 0; b < c.K / 32; ++b) {
      int code[32];
      const float d = ref_quantize_block(&x[m * c.K + 32 * b], code);
      ok = ok && a.dx[m * a.blocks + b] == d;
      for (int i = 0; i < 32; ++i) {
        ok = ok && a.xq[m * c.K + 32 * b + i] == code[i];
        xr[m * c.K + 32 * b + i] = static_cast<double>(d) * code[i];
      }
    }
  return ok;
}

void run_gemv_case(std::mt19937& rng, const GemvCase& c, Tally& t) {
  const Weights w = make_weights(rng, c);
  const std::vector<float> x = make_acts(rng, c.M, c.K);
  const ferry_neon::Int8Acts a = ferry_neon::quantize_acts(x.data(), c.M, c.K, c.G);
  std::vector<double> xr;
  t.check(acts_match(a, x, c, xr), c.name() + ": activation codes / scales differ from the reference");
  std::vector<float> y(c.M * c.N, NAN), y2(c.M * c.N, NAN);
  ferry_neon::gemv_rows(w.view, a, 0, c.N, y.data(), c.N);
  const int64_t cut = c.N / 2 + 1;  // a thread split must give the very same numbers
  ferry_neon::gemv_rows(w.view, a, 0, std::min(cut, c.N), y2.data(), c.N);
  ferry_neon::gemv_rows(w.view, a, std::min(cut, c.N), c.N, y2.data(), c.N);
  t.check(std::memcmp(y.data(), y2.data(), y.size() * sizeof(float)) == 0, c.name() + ": split rows differ");
  for (int64_t m = 0; m < c.M; ++m)
    for (int64_t n = 0; n < c.N; ++n) {
      double ref = 0, mag = 0;  // mag: the sum of |terms|, the scale of fp32 summation error
      for (int64_t k = 0; k < c.K; ++k) {
        const int64_t g = n * (c.K / c.G) + k / c.G;
        const double sq = static_cast<double>(w.scale(g)) * w.code(n, k), mn = w.min(g);
        ref += (sq + mn) * xr[m * c.K + k];
        mag += (std::fabs(sq) + std::fabs(mn)) * std::fabs(xr[m * c.K + k]);
      }
      const double err = std::fabs(y[m * c.N + n] - ref), bound = 1e-4 * std::fabs(ref) + 1e-6 * mag;
      t.worst_gemv = std::max(t.worst_gemv, err / (std::fabs(ref) + 1e-2 * mag));
      if (!(err <= bound)) {
        char buf[128];
        std::snprintf(buf, sizeof buf, " m=%ld n=%ld: %.9g vs %.9g (mag %.3g)", (long)m, (long)n, y[m * c.N + n], ref,
                      mag);
        t.check(false, c.name() + buf);
        return;
      }
    }
  t.check(true, c.name());
}

void check_gemv(std::mt19937& rng, Tally& t) {
  struct Kind {
    bool q4, mins;
  };
  const Kind kinds[] = {{true, false}, {true, true}, {false, false}, {false, true}};
  // Per group size: a few blocks (odd counts among them) and a row past one 64-block chunk.
  const std::vector<std::pair<int64_t, std::vector<int64_t>>> shapes = {
      {16, {96, 2112}}, {32, {96, 160, 2112}}, {64, {128, 192, 2112}}, {128, {384, 2176}}};
  const int64_t Ns[] = {1, 7, 16, 21};
  for (const Kind& k : kinds)
    for (const auto& [G, Ks] : shapes) {
      if (k.q4 && G == 16) continue;  // q4 has no 16-element groups
      for (int64_t K : Ks)
        for (bool f16 : {true, false})
          for (int64_t M = 1; M <= ferry_neon::GEMV_MAX_ROWS; ++M)
            for (int64_t N : Ns) {
              if (K > 1000 && N > 7) continue;  // long rows: a tail and a 4-row tile are enough
              run_gemv_case(rng, {k.q4, k.mins, f16, G, K, N, M}, t);
            }
    }
}

// ---------------------------------------------------------------- attention helpers and decode

void check_exp4(Tally& t) {
  // exp4 against exp in float64 over the range softmax feeds it: relative error while the result is
  // normal (x >= -86), absolute below (results under 2^-125 may be 0)
  double worst = 0, worst_abs = 0;
  for (int i = 0; i < 400000; i += 4) {
    float xs[4], ys[4];
    for (int j = 0; j < 4; ++j) xs[j] = -90.f * static_cast<float>(i + j) / 400000.f;
    vst1q_f32(ys, ferry_neon::exp4(vld1q_f32(xs)));
    for (int j = 0; j < 4; ++j) {
      const double e = std::exp(static_cast<double>(xs[j]));
      if (xs[j] >= -86.f) worst = std::max(worst, std::fabs(ys[j] - e) / e);
      else worst_abs = std::max(worst_abs, std::fabs(ys[j] - e));
    }
  }
  t.worst_exp = worst;
  t.check(worst < 3e-7, "exp4: relative error " + std::to_string(worst));
  t.check(worst_abs <= std::ldexp(1.0, -125), "exp4: absolute error below exp(-86) " + std::to_string(worst_abs));
  float big[4] = {-INFINITY, -200.f, -104.f, 0.f}, out[4];
  vst1q_f32(out, ferry_neon::exp4(vld1q_f32(big)));
  t.check(out[0] == 0.f && out[1] == 0.f && out[2] == 0.f && out[3] == 1.f, "exp4: -inf, underflow, 0");
}

void check_vector_helpers(std::mt19937& rng, Tally& t) {
  std::uniform_real_distribution<float> u(-3.f, 3.f);
  for (int64_t n = 0; n <= 41; ++n) {
    std::vector<float> a(n), b(n), acc(n), acc0;
    for (int64_t i = 0; i < n; ++i) a[i] = u(rng), b[i] = u(rng), acc[i] = u(rng);
    acc0 = acc;
    double ref = 0, mag = 0;
    for (int64_t i = 0; i < n; ++i) ref += double(a[i]) * b[i], mag += std::fabs(double(a[i]) * b[i]);
    const float got = ferry_neon::dot(a.data(), b.data(), n);
    t.check(std::fabs(got - ref) <= 1e-6 * mag, "dot n=" + std::to_string(n));
    ferry_neon::axpy(0.37f, b.data(), acc.data(), n);
    bool ok = true;
    for (int64_t i = 0; i < n; ++i)
      ok = ok && std::fabs(acc[i] - (acc0[i] + 0.37 * b[i])) <= 1e-6 * (std::fabs(acc0[i]) + 2);
    t.check(ok, "axpy n=" + std::to_string(n));
  }
  for (int64_t S : {1, 2, 3, 4, 5, 7, 8, 9, 17, 300}) {
    std::vector<float> s(S);
    for (auto& v : s) v = 6.f * u(rng);
    std::vector<double> e(S);
    const double m = *std::max_element(s.begin(), s.end());
    double sum = 0;
    for (int64_t i = 0; i < S; ++i) sum += e[i] = std::exp(s[i] - m);
    ferry_neon::softmax_(s.data(), S);
    bool ok = true;
    for (int64_t i = 0; i < S; ++i) ok = ok && std::fabs(s[i] - e[i] / sum) <= 1e-6 * (e[i] / sum) + 1e-9;
    t.check(ok, "softmax_ S=" + std::to_string(S));
  }
}

struct DecodeCase {
  int64_t D, G;
  std::vector<int64_t> lens;
  int64_t window = 0;  // > 0: each sequence attends to its last `window` keys only
};

// float64 attention of one (sequence, head): out[D].
void ref_attention(const float* q, const std::vector<const float*>& krows, const std::vector<const float*>& vrows,
                   int64_t D, double scale, double* out) {
  const int64_t S = krows.size();
  std::vector<double> p(S);
  double m = -INFINITY, sum = 0;
  for (int64_t t = 0; t < S; ++t) {
    double s = 0;
    for (int64_t d = 0; d < D; ++d) s += double(q[d]) * krows[t][d];
    p[t] = s * scale, m = std::max(m, p[t]);
  }
  for (auto& v : p) sum += v = std::exp(v - m);
  for (int64_t d = 0; d < D; ++d) {
    double o = 0;
    for (int64_t t = 0; t < S; ++t) o += p[t] / sum * vrows[t][d];
    out[d] = S ? o : 0.0;
  }
}

// A batch in paged caches: shuffled block tables (unused entries huge, never to be read), every slot
// no sequence owns NaN, so reading a wrong row poisons the output.
struct DecodeBatch {
  int64_t B, H, Hkv = 2, D, bs = 16, max_blocks = 1;
  std::vector<int64_t> tables;
  std::vector<float> kc, vc, q;
  int64_t at(int64_t b, int64_t tok, int64_t kvh) const {  // where token tok's row of KV head kvh starts
    const int64_t slot = tables[b * max_blocks + tok / bs] * bs + tok % bs;
    return (slot * Hkv + kvh) * D;
  }
};

DecodeBatch make_batch(std::mt19937& rng, const DecodeCase& c) {
  DecodeBatch x;
  x.B = c.lens.size(), x.H = c.G * x.Hkv, x.D = c.D;
  int64_t total = 0;
  for (int64_t len : c.lens) {
    total += (len + x.bs - 1) / x.bs;
    x.max_blocks = std::max(x.max_blocks, (len + x.bs - 1) / x.bs);
  }
  const int64_t num_blocks = total + 3;
  std::vector<int64_t> perm(num_blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  x.tables.assign(x.B * x.max_blocks, int64_t(1) << 40);
  for (int64_t b = 0, next = 0; b < x.B; ++b)
    for (int64_t i = 0; i < (c.lens[b] + x.bs - 1) / x.bs; ++i) x.tables[b * x.max_blocks + i] = perm[next++];
  x.kc.assign(num_blocks * x.bs * x.Hkv * x.D, NAN);
  x.vc = x.kc;
  std::uniform_real_distribution<float> u(-2.f, 2.f);
  for (int64_t b = 0; b < x.B; ++b)
    for (int64_t tok = 0; tok < c.lens[b]; ++tok)
      for (int64_t h = 0; h < x.Hkv; ++h)
        for (int64_t d = 0; d < x.D; ++d) x.kc[x.at(b, tok, h) + d] = u(rng), x.vc[x.at(b, tok, h) + d] = u(rng);
  x.q.resize(x.B * x.H * x.D);
  for (auto& v : x.q) v = u(rng);
  return x;
}

void run_decode_case(std::mt19937& rng, const DecodeCase& c, Tally& t) {
  const DecodeBatch x = make_batch(rng, c);
  const int64_t D = x.D, H = x.H;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  std::vector<float> out(x.B * H * D, NAN);
  ferry_neon::decode_attention(x.q.data(), x.kc.data(), x.vc.data(), x.tables.data(), c.lens.data(), out.data(), x.B,
                               H, x.Hkv, D, x.bs, x.max_blocks, scale, c.window);
  std::vector<double> ref(D);
  for (int64_t b = 0; b < x.B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      std::vector<const float*> kr, vr;
      const int64_t lo = c.window > 0 ? std::max<int64_t>(0, c.lens[b] - c.window) : 0;
      for (int64_t tok = lo; tok < c.lens[b]; ++tok)
        kr.push_back(&x.kc[x.at(b, tok, h / c.G)]), vr.push_back(&x.vc[x.at(b, tok, h / c.G)]);
      ref_attention(&x.q[(b * H + h) * D], kr, vr, D, scale, ref.data());
      double err = 0, top = 0;
      for (int64_t d = 0; d < D; ++d) {
        const double o = out[(b * H + h) * D + d];
        err = std::isnan(o) ? INFINITY : std::max(err, std::fabs(o - ref[d]));
        top = std::max(top, std::fabs(ref[d]));
      }
      const double ratio = c.lens[b] ? err / top : err;
      t.worst_decode = std::max(t.worst_decode, ratio);
      char buf[128];
      std::snprintf(buf, sizeof buf, "decode D=%ld G=%ld S=%ld head %ld: error %.3g of the largest output", (long)D,
                    (long)c.G, (long)c.lens[b], (long)h, ratio);
      t.check(ratio <= 1e-4, buf);
    }
}

void check_decode(std::mt19937& rng, Tally& t) {
  for (int64_t D : {64, 128, 80, 36})
    for (int64_t G : {1, 3, 5}) {
      if ((D == 80 || D == 36) && G == 5) continue;
      run_decode_case(rng, {D, G, {1, 17, 300}}, t);
    }
  run_decode_case(rng, {64, 3, {0, 16, 5}}, t);  // an empty sequence writes zeros
  for (int64_t window : {1, 7, 16, 40})  // sliding windows inside and across blocks, and longer than a context
    run_decode_case(rng, {64, 3, {1, 17, 300, 5}, window}, t);
}

}  // namespace

int main() {
  std::mt19937 rng(20240611);
  Tally t;
  check_ties(t);
  check_gemv(rng, t);
  check_exp4(t);
  check_vector_helpers(rng, t);
  check_decode(rng, t);
#if defined(__ARM_FEATURE_DOTPROD)
  const int dotprod = 1;
#else
  const int dotprod = 0;
#endif
  std::printf("neon_kernels_test: dotprod=%d worst gemv error %.3g (of |ref| + 1e-2 sum|terms|), decode %.3g, "
              "exp4 %.3g\n", dotprod, t.worst_gemv, t.worst_decode, t.worst_exp);
  std::printf("%s: %d passed, %d failed\n", t.fail ? "FAIL" : "PASS", t.pass, t.fail);
  return t.fail ? 1 : 0;
}
