// The direct path of the blocked GEMM (gemm_blocked.h), for FP32 weight gradients: nothing
// packed, both operands read where they are stored.
//
// A weight gradient's product may take a third path, the direct one, before the fused one, where
// P declares kDirect and says in direct_suits(M, N, K) which shapes take it, each thread has a
// row block of its own, neither operand's rows are a multiple of 4 KiB apart and every row of
// both starts a cache line (blocked_plan);
// P provides a tile of its own, kDirectMR x kDirectNR, and
//   micro_direct(kc, a, lda, b, ldb, C, ldc, beta, m, n): C[0:m, 0:n] = the product over kc K
//       rows + beta C, A's columns i..i+m and B's columns j..j+n read where they are stored,
//       row k at a + k * lda and b + k * ldb;
// each thread takes its own rows of C (all columns) and runs, per K block of KC and group of
// kDirectGroupPanels micro-panels of kDirectNR columns, over row blocks of kDirectRowPanels
// micro-panels of kDirectMR rows, for each over the group's micro-panels of columns and then
// over the row block's micro-panels. Nothing is packed: the group's columns of the block's
// rows of B stay in L2 while the thread's row blocks pass over them. Each tile sums the
// same K blocks in the same order as on the blocked path, so the bits are the same again.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "kernels/gemm/gemm_plan.h"

namespace cputrain::kernels::detail {

// The direct path (see the top of this file): C (FP32) = op(A) op(B) + beta C with A and B both
// stored (K, *), read where they are. A thread's rows are a contiguous share of M, in whole
// micro-panels.
template <class P>
void gemm_direct(const BlockedPlan<P>& plan, int64_t M, int64_t N, int64_t K,
                 const typename P::In* A, int64_t lda, const typename P::In* B, int64_t ldb,
                 float beta, float* C, int64_t ldc) {
  constexpr int64_t MR = P::kDirectMR, NR = P::kDirectNR, KC = P::KC;
  constexpr int64_t rows_per_block = P::kDirectRowPanels * MR;
  constexpr int64_t group_cols = P::kDirectGroupPanels * NR;
#pragma omp parallel num_threads(plan.threads)
  {
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    // Shares of M in whole micro-panels, so that A's values a K step reads share a cache line.
    const auto share = [&](int64_t u) { return u == nt ? M : M * u / nt / MR * MR; };
    const int64_t row_begin = share(t), row_end = share(t + 1);
    for (int64_t pc = 0; pc < K; pc += KC) {
      const int64_t kc = std::min(KC, K - pc);
      const float beta_block = pc == 0 ? beta : 1.0f;
      for (int64_t g0 = 0; g0 < N; g0 += group_cols) {
        const int64_t g1 = std::min(N, g0 + group_cols);
        for (int64_t r0 = row_begin; r0 < row_end; r0 += rows_per_block) {
          const int64_t r1 = std::min(row_end, r0 + rows_per_block);
          for (int64_t j = g0; j < g1; j += NR) {
            const int n = static_cast<int>(std::min(NR, g1 - j));
            for (int64_t i = r0; i < r1; i += MR) {
              const int m = static_cast<int>(std::min(MR, r1 - i));
              P::micro_direct(kc, A + pc * lda + i, lda, B + pc * ldb + j, ldb, C + i * ldc + j,
                              ldc, beta_block, m, n);
            }
          }
        }
      }
    }
  }
}

}  // namespace cputrain::kernels::detail
