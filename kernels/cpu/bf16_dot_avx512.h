// Products on bf16 pairs (the operand layout of bf16_pairs_avx512.h) with vdpbf16ps, shared by
// the bf16 attention and Gated DeltaNet's chunk products: C (+)= A B with A as rows of pairs
// (or, PairRows, pairs x rows) and B as pairs x columns, every product of two bf16 values exact
// in FP32 and summed in FP32. dp_product sends whole tiles of 16 rows to AMX where the caller
// asks (pairs_amx.h). Included by files compiled with AVX-512 BF16 flags only.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cpu/pairs_amx.h"

namespace cputrain::kernels::detail {
namespace {

// R rows x NV vectors of C (+)= sum_p A[r][p] . B[p][16 v ..], the dot products of bf16 pairs;
// A[r][p] at A[r * lda + p], or with PairRows at A[p * lda + r] (A stored as pairs x rows).
template <int R, int NV, bool PairRows = false>
inline __attribute__((always_inline)) void dp_block(float* C, int64_t ldc, const uint32_t* A,
                                                    int64_t lda, const uint32_t* B, int64_t ldb,
                                                    int64_t pairs, bool accumulate) {
  __m512 acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      acc[r][v] = accumulate ? _mm512_loadu_ps(C + r * ldc + 16 * v) : _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(B + p * ldb + 16 * v);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const uint32_t pair = PairRows ? A[p * lda + r] : A[r * lda + p];
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(C + r * ldc + 16 * v, acc[r][v]);
}

template <int NV, bool PairRows = false>
inline void dp_columns(float* C, int64_t ldc, const uint32_t* A, int64_t lda, const uint32_t* B,
                       int64_t ldb, int64_t M, int64_t pairs, bool accumulate) {
  const int64_t row_step = PairRows ? 1 : lda;  // from one row of A to the next
  int64_t m = 0;
  for (; m + 6 <= M; m += 6)
    dp_block<6, NV, PairRows>(C + m * ldc, ldc, A + m * row_step, lda, B, ldb, pairs, accumulate);
  if (m + 4 <= M) {
    dp_block<4, NV, PairRows>(C + m * ldc, ldc, A + m * row_step, lda, B, ldb, pairs, accumulate);
    m += 4;
  }
  if (m + 2 <= M) {
    dp_block<2, NV, PairRows>(C + m * ldc, ldc, A + m * row_step, lda, B, ldb, pairs, accumulate);
    m += 2;
  }
  if (m < M)
    dp_block<1, NV, PairRows>(C + m * ldc, ldc, A + m * row_step, lda, B, ldb, pairs, accumulate);
}

// C[0:M, 0:N] (+)= A B over `pairs` bf16 pairs on vdpbf16ps, 64 columns at a time: A as
// dp_block reads it (PairRows: stored as pairs x M), B (pairs x N, row stride ldb), N a multiple
// of 16.
template <bool PairRows>
inline void dp_column_blocks(float* C, int64_t ldc, const uint32_t* A, int64_t lda,
                             const uint32_t* B, int64_t ldb, int64_t M, int64_t N, int64_t pairs,
                             bool accumulate) {
  for (int64_t n0 = 0; n0 < N; n0 += 64) {
    switch (std::min<int64_t>(4, (N - n0) / 16)) {
      case 4:
        dp_columns<4, PairRows>(C + n0, ldc, A, lda, B + n0, ldb, M, pairs, accumulate);
        break;
      case 3:
        dp_columns<3, PairRows>(C + n0, ldc, A, lda, B + n0, ldb, M, pairs, accumulate);
        break;
      case 2:
        dp_columns<2, PairRows>(C + n0, ldc, A, lda, B + n0, ldb, M, pairs, accumulate);
        break;
      default:
        dp_columns<1, PairRows>(C + n0, ldc, A, lda, B + n0, ldb, M, pairs, accumulate);
        break;
    }
  }
}

// C[0:M, 0:N] += A^T B over `pairs` bf16 pairs on vdpbf16ps: A stored as pairs x M (row stride
// lda), B (pairs x N, row stride ldb), N a multiple of 16. The same sums, term for term, as
// dp_product of A's transpose (a product of two bf16 values is exact in FP32).
inline void dp_product_pair_rows(float* C, int64_t ldc, const uint32_t* A, int64_t lda,
                                 const uint32_t* B, int64_t ldb, int64_t M, int64_t N,
                                 int64_t pairs) {
  dp_column_blocks<true>(C, ldc, A, lda, B, ldb, M, N, pairs, true);
}

// C[0:M, 0:N] (+)= A B over `pairs` bf16 pairs: A (M x pairs, row stride lda), B (pairs x N,
// row stride ldb), N a multiple of 16. With amx, the rows in whole tiles of 16 go to AMX where
// pairs is a multiple of 16 (the tile configuration loaded on this thread), the rest here.
inline void dp_product(bool amx, float* C, int64_t ldc, const uint32_t* A, int64_t lda,
                       const uint32_t* B, int64_t ldb, int64_t M, int64_t N, int64_t pairs,
                       bool accumulate) {
  if (amx && pairs % 16 == 0 && M >= 16) {
    const int64_t tiled = M / 16 * 16;
    pairs_product_amx(C, ldc, A, lda, B, ldb, tiled, N, pairs, accumulate);
    if (tiled == M) return;
    C += tiled * ldc;
    A += tiled * lda;
    M -= tiled;
  }
  dp_column_blocks<false>(C, ldc, A, lda, B, ldb, M, N, pairs, accumulate);
}

}  // namespace
}  // namespace cputrain::kernels::detail
