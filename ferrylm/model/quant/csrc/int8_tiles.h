// The int8-activation tiles as the ops call them (vnni_gemv.cpp, moe_experts.cpp): which width runs on
// this CPU, and output rows n..n+NB-1 for a few activation rows by the tiles it picks.
#pragma once
#include <cstdlib>
#include <cstring>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include "int8_acts.h"
#include "int8_ymm.h"
#include "int8_zmm.h"

namespace ferry_quant {

// Activation rows per tile (a decode step of a few sequences, or the verify step of a speculative draft
// of up to 7 tokens): each weight code is loaded and unpacked once for all of them. A call with more rows
// runs them in chunks of this many against the same weight tile.
constexpr int64_t MAX_ROWS = 8;

#ifdef FERRY_INT8
// Whether the 512-bit tiles multiply: where the CPU runs 512-bit ops at full width. AMD's Zen 4 splits
// each in two, and there the 256-bit tiles were faster: a whole SmolLM2 token's int8 GEMVs (30 layers + the
// LM head, 2 threads) took 9.5 ms with the 512-bit VNNI tiles and 7.3 ms with the 256-bit ones, bf16 and
// fp32 x alike (2026-12-03). FERRYLM_INT8_TILES=256 or 512 overrides (tests run both).
inline bool use_zmm() {
#ifdef FERRY_VNNI
  if (const char* forced = std::getenv("FERRYLM_INT8_TILES")) return std::strcmp(forced, "256") != 0;
  static const bool amd = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    return __get_cpuid(0, &eax, &ebx, &ecx, &edx) && ebx == 0x68747541;  // "Auth"enticAMD
  }();
  return !amd;
#else
  return false;
#endif
}

// Output rows n..n+NB-1 for a few activation rows, by the tiles `wide` picks.
template <int NB>
inline void tile_rows(bool wide, bool q4, const Packed& w, const Acts& a, int64_t n, float* out) {
#ifdef FERRY_VNNI
  if (wide) {
    if (q4) zmm::tile_rows<true, NB>(w, a, n, out);
    else zmm::tile_rows<false, NB>(w, a, n, out);
    return;
  }
#endif
#ifdef FERRY_INT8_YMM
  if (q4) ymm::tile_rows<true, NB>(w, a, n, out);
  else ymm::tile_rows<false, NB>(w, a, n, out);
#endif
}

// Weight rows [lo, hi) (at most 16) against a few activation rows, into out[m * 16 + (n - lo)]: four weight
// rows side by side, each loaded step once for all activation rows; but one activation row on the 256-bit
// tiles takes one weight row at a time. A 1-row GEMV only streams memory, and four rows read side by
// side are four interleaved streams that the hardware prefetcher served worse than one: on an AVX2 Zen 3
// (2 threads) an MoE GGUF token took 12.0 ms instead of 14.8 (medians of 5 alternating runs), 16-stream
// steps 95 instead of 111 ms, and SmolLM2 (Q4_1) 9.3 vs 9.2 ms. The 512-bit tiles were not measured so.
inline void tile_span(bool wide, bool q4, const Packed& w, const Acts& a, int64_t lo, int64_t hi, float* out) {
  int64_t n = lo;
  if (wide || a.M > 1)
    for (; n + 4 <= hi; n += 4) tile_rows<4>(wide, q4, w, a, n, out + (n - lo));
  for (; n < hi; ++n) tile_rows<1>(wide, q4, w, a, n, out + (n - lo));
}
#endif

}  // namespace ferry_quant
