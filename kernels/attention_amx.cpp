// The products of the bf16 attention (attention_bf16_avx512.cpp) on AMX tiles: C (+)= A B with
// A rows of bf16 pairs (a tile is 16 rows x 16 pairs) and B pairs x columns (a tile is 16 pairs
// x 16 columns), exactly the operand layouts the vdpbf16ps products use, so the attention's
// packing is the same on both paths. Reached only where cpu_features().amx_bf16 is set.
#include <immintrin.h>

#include <cstdint>

#include "kernels/amx_tiles.h"
#include "kernels/attention_isa.h"

namespace cputrain::kernels {
namespace {

// MT x NT tiles of 16 x 16 (C tiles 0, 1 in the first row, 2, 3 in the second; A in 4, 5; B in
// 6, 7), over `pairs` (a multiple of 16).
template <int MT, int NT>
void tile_block(float* C, int64_t ldc, const uint32_t* A, int64_t lda, const uint32_t* B,
                int64_t ldb, int64_t pairs, bool accumulate) {
  const int64_t cs = ldc * 4, as = lda * 4, bs = ldb * 4;
  if (accumulate) {
    _tile_loadd(0, C, cs);
    if (NT > 1) _tile_loadd(1, C + 16, cs);
    if (MT > 1) _tile_loadd(2, C + 16 * ldc, cs);
    if (MT > 1 && NT > 1) _tile_loadd(3, C + 16 * ldc + 16, cs);
  } else {
    _tile_zero(0);
    if (NT > 1) _tile_zero(1);
    if (MT > 1) _tile_zero(2);
    if (MT > 1 && NT > 1) _tile_zero(3);
  }
  for (int64_t p = 0; p < pairs; p += 16) {
    _tile_loadd(4, A + p, as);
    _tile_loadd(6, B + p * ldb, bs);
    if (NT > 1) _tile_loadd(7, B + p * ldb + 16, bs);
    _tile_dpbf16ps(0, 4, 6);
    if (NT > 1) _tile_dpbf16ps(1, 4, 7);
    if (MT > 1) {
      _tile_loadd(5, A + 16 * lda + p, as);
      _tile_dpbf16ps(2, 5, 6);
      if (NT > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, C, cs);
  if (NT > 1) _tile_stored(1, C + 16, cs);
  if (MT > 1) _tile_stored(2, C + 16 * ldc, cs);
  if (MT > 1 && NT > 1) _tile_stored(3, C + 16 * ldc + 16, cs);
}

}  // namespace

void attention_amx_configure() {
  load_full_tile_config();
}

void attention_product_amx(float* C, int64_t ldc, const uint32_t* A, int64_t lda, const uint32_t* B,
                           int64_t ldb, int64_t M, int64_t N, int64_t pairs, bool accumulate) {
  for (int64_t m0 = 0; m0 < M; m0 += 32) {
    const bool two_rows = M - m0 >= 32;
    for (int64_t n0 = 0; n0 < N; n0 += 32) {
      const bool two_cols = N - n0 >= 32;
      float* c = C + m0 * ldc + n0;
      const uint32_t *a = A + m0 * lda, *b = B + n0;
      if (two_rows && two_cols)
        tile_block<2, 2>(c, ldc, a, lda, b, ldb, pairs, accumulate);
      else if (two_rows)
        tile_block<2, 1>(c, ldc, a, lda, b, ldb, pairs, accumulate);
      else if (two_cols)
        tile_block<1, 2>(c, ldc, a, lda, b, ldb, pairs, accumulate);
      else
        tile_block<1, 1>(c, ldc, a, lda, b, ldb, pairs, accumulate);
    }
  }
}

}  // namespace cputrain::kernels
