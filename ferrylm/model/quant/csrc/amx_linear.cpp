// Large batches (prefill, many decoding sequences) on AMX tiles, for bf16 activations.
//
// Per panel of 32 output rows, W is unpacked once into a bf16 buffer that stays in L1/L2 (row-major, the
// A operand of the tile multiply); x is rearranged once per call into VNNI pairs (the B operand); each
// C tile holds [16 outputs x 16 activation rows] and is written out transposed. The unpacked weights
// equal torch's `dequantize().to(bf16)`, so this path computes what the dequantized bf16 model does,
// without writing the bf16 weight to memory (torch's bf16 GEMM reorders its weight on every call too).
#include <ATen/Parallel.h>
#include <vector>

#include "packed.h"

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define FERRY_AMX 1
#endif

namespace ferry_quant {

#ifdef FERRY_AMX
namespace {

constexpr int64_t ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;

struct TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: C (fp32 16 x 16), 4-5: A (weights, 16 rows x 32 bf16), 6-7: B (x, 16 pairs x 16 rows).
void configure_tiles() {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) {
    cfg.rows[i] = 16;
    cfg.colsb[i] = 64;
  }
  _tile_loadconfig(&cfg);
}

// x [M, K] → xv[mb][kp][m] = the bf16 pair x[16 mb + m][2 kp, 2 kp + 1] as one uint32 (0 past M).
std::vector<uint32_t> to_vnni(const at::BFloat16* x, int64_t M, int64_t K) {
  const int64_t MB = (M + 15) / 16, KP = K / 2;
  std::vector<uint32_t> xv(MB * KP * 16, 0u);
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(x);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t kp = 0; kp < KP; ++kp) xv[((m / 16) * KP + kp) * 16 + m % 16] = pairs[m * KP + kp];
  return xv;
}

// Rows [n0, n0 + 32) of W as bf16 into wbuf [32, K]; rows past N are zero.
void unpack_panel(const Packed& w, bool q4, int64_t K, int64_t N, int64_t n0, uint16_t* wbuf, float* s, float* z) {
  alignas(64) float row[32];
  for (int64_t r = 0; r < 32; ++r) {
    uint16_t* dst = wbuf + r * K;
    if (n0 + r >= N) {
      std::memset(dst, 0, K * sizeof(uint16_t));
      continue;
    }
    stage_row(w, n0 + r, s, z);
    for_each_block(w, K, [&](int64_t k, int64_t g) {
      unpack32(w, q4, n0 + r, k, s + g, z + g, w.G == 16, row);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(row)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k + 16), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(row + 16)));
    });
  }
}

// C tile [16 outputs][16 rows] → out[m][n0 .. n0 + 16) in bf16, for rows m0 + i < M and columns < N.
void store_tile(const float* c, int64_t m0, int64_t M, int64_t n0, int64_t N, at::BFloat16* out) {
  const __m512i idx = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  const __mmask16 cols = N - n0 >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (N - n0)) - 1);
  for (int64_t i = 0; i < 16 && m0 + i < M; ++i) {
    const __m512 v = _mm512_i32gather_ps(idx, c + i, 4);
    _mm256_mask_storeu_epi16(out + (m0 + i) * N + n0, cols, (__m256i)_mm512_cvtneps_pbh(v));
  }
}

void panel(const Packed& w, bool q4, int64_t K, int64_t N, int64_t n0, const uint32_t* xv, int64_t M,
           uint16_t* wbuf, float* s, float* z, at::BFloat16* out) {
  unpack_panel(w, q4, K, N, n0, wbuf, s, z);
  const int64_t MB = (M + 15) / 16, KP = K / 2, stride = K * 2;
  alignas(64) float c[4][256];
  for (int64_t mb = 0; mb < MB; mb += 2) {
    const bool two = mb + 1 < MB;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < K; k += 32) {
      _tile_loadd(4, wbuf + k, stride);
      _tile_loadd(5, wbuf + 16 * K + k, stride);
      _tile_loadd(6, xv + (mb * KP + k / 2) * 16, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(2, 5, 6);
      if (two) {
        _tile_loadd(7, xv + ((mb + 1) * KP + k / 2) * 16, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(2, c[2], 64);
    store_tile(c[0], mb * 16, M, n0, N, out);
    if (n0 + 16 < N) store_tile(c[2], mb * 16, M, n0 + 16, N, out);
    if (two) {
      _tile_stored(1, c[1], 64);
      _tile_stored(3, c[3], 64);
      store_tile(c[1], (mb + 1) * 16, M, n0, N, out);
      if (n0 + 16 < N) store_tile(c[3], (mb + 1) * 16, M, n0 + 16, N, out);
    }
  }
}

bool probe_amx() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return false;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;  // the OS must allow tile state
}

}  // namespace

bool amx_available() {
  static const bool ok = probe_amx();  // one probe per process; the permission is process-wide
  return ok;
}

torch::Tensor amx_linear(const torch::Tensor& x, const Packed& w, bool q4) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "amx_linear: contiguous bf16 x");
  const int64_t M = x.size(0), K = x.size(1), rows = w.rows;
  const std::vector<uint32_t> xv = to_vnni(x.data_ptr<at::BFloat16>(), M, K);
  torch::Tensor out = torch::empty({M, rows}, x.options());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, (rows + 31) / 32, 1, [&](int64_t p0, int64_t p1) {
    configure_tiles();
    std::vector<uint16_t> wbuf(32 * K + 32);
    std::vector<float> s(w.groups + 16), z(w.groups + 16);
    for (int64_t p = p0; p < p1; ++p) panel(w, q4, K, rows, p * 32, xv.data(), M, wbuf.data(), s.data(), z.data(), op);
    _tile_release();
  });
  return out;
}
#else
bool amx_available() { return false; }
torch::Tensor amx_linear(const torch::Tensor&, const Packed&, bool) { TORCH_CHECK(false, "built without AMX"); }
#endif

}  // namespace ferry_quant
