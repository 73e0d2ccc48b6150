// Packing of bf16 GEMM operands as K pairs shared by the AVX-512 BF16 and the AMX kernels, whose
// B micro-panels have the same layout: 32 columns, one 32-bit pair per column and K pair.
// Included by files compiled with AVX-512 BW flags only.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cpu/bf16_pairs_avx512.h"
#include "kernels/gemm/gemm_avx512_tile.h"

namespace cputrain::kernels::detail {
namespace {

// Where stored rows are packed a few at a time (gemm_plan.h's kPackRows), the same columns
// of the rows kPrefetchRows on: fetched now, they have arrived when the driver gets there. (Rows
// read side by side, at a stride, are more streams than the hardware prefetcher follows.)
constexpr int64_t kPrefetchRows = 32;
inline void prefetch_rows_ahead(const uint16_t* row, int64_t ld, int64_t ahead = kPrefetchRows) {
  _mm_prefetch(reinterpret_cast<const char*>(row + ahead * ld), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(row + (ahead + 1) * ld), _MM_HINT_T0);
}

// dst[p][c] = (op(B)[k0 + 2p][j0 + c], op(B)[k0 + 2p + 1][j0 + c]) for c < 32, p < ceil(kc / 2),
// where op(B) has n columns from j0 on; columns at or past n, and the second half of a last odd
// pair, are zero.
inline void pack_b_pairs32(uint32_t* dst, const uint16_t* B, int64_t ldb, bool trans, int64_t j0,
                           int64_t n, int64_t k0, int64_t kc) {
  constexpr int64_t NR = 32;
  const int64_t kp = (kc + 1) / 2;
  if (!trans) {  // B stored (K, N): interleave rows k and k + 1
    for (int64_t p = 0; p < kp; ++p) {
      const uint16_t* row = B + (k0 + 2 * p) * ldb + j0;
      prefetch_rows_ahead(row, ldb);
      interleave_pairs(dst + p * NR, row, 2 * p + 1 < kc ? row + ldb : nullptr, n, NR);
    }
    return;
  }
  // B stored (N, K): a pair is one 32-bit element of a row; transpose 16 x 16 blocks.
  const int64_t full = kc / 2;
  for (int64_t half = 0; half < 2; ++half) {
    const int rows = static_cast<int>(std::clamp<int64_t>(n - 16 * half, 0, 16));
    pack_transposed(dst + 16 * half, NR, 16, B + (j0 + 16 * half) * ldb + k0, ldb * 2, rows, full);
  }
  if (full < kp) {
    for (int64_t c = 0; c < NR; ++c)
      dst[full * NR + c] = c < n ? bf16_pair(B[(j0 + c) * ldb + k0 + kc - 1], 0) : 0;
  }
}

}  // namespace
}  // namespace cputrain::kernels::detail
