// The register tile shared by the AVX-512 micro-kernels: MR rows x 32 columns of FP32
// accumulators (two zmm per row), and its store into C with beta and edge masks. Included by
// files compiled with AVX-512 flags only.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace cputrain::kernels::detail {
namespace {

constexpr int kTileRows = 14;  // 28 accumulators + 2 B vectors + 1 broadcast of 32 zmm
constexpr int kTileCols = 32;

struct Tile {
  __m512 lo[kTileRows];
  __m512 hi[kTileRows];
};

// C[0:m, 0:n] = tile + beta * C (beta 0 overwrites, never reading C).
inline __attribute__((always_inline)) void store_tile(const Tile& t, float* C, int64_t ldc,
                                                      float beta, int m, int n) {
  const __mmask16 mask_lo = n >= 16 ? 0xffff : static_cast<__mmask16>((1u << n) - 1);
  const __mmask16 mask_hi =
      n >= 32 ? 0xffff : n > 16 ? static_cast<__mmask16>((1u << (n - 16)) - 1) : 0;
  const __m512 vbeta = _mm512_set1_ps(beta);
#pragma GCC unroll 14
  for (int r = 0; r < kTileRows; ++r) {
    if (r >= m) break;
    float* row = C + r * ldc;
    __m512 lo = t.lo[r], hi = t.hi[r];
    if (beta != 0.0f) {
      lo = _mm512_fmadd_ps(vbeta, _mm512_maskz_loadu_ps(mask_lo, row), lo);
      hi = _mm512_fmadd_ps(vbeta, _mm512_maskz_loadu_ps(mask_hi, row + 16), hi);
    }
    _mm512_mask_storeu_ps(row, mask_lo, lo);
    _mm512_mask_storeu_ps(row + 16, mask_hi, hi);
  }
}

}  // namespace
}  // namespace cputrain::kernels::detail
