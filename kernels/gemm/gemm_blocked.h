// The blocked GEMM driver (after BLIS): loops around a register-blocked micro-kernel, over panels
// of A and B packed for it. Only the packing and the micro-kernel differ per data type and ISA;
// they come in a policy P, and this header is included by each ISA's file so that the whole
// driver is compiled with that ISA's flags.
//
//   for jc in N by NC            columns of C (NC and MC: the tuning, kernels/gemm/gemm_tuning.h)
//     for ps in K by KS          a super-block of K blocks of KC (KS = KC for a transposed A):
//                                its B (KS x NC) packed by all threads together
//       work items (block of up to MC rows) x (group of NR-column micro-panels), handed out
//       one ahead from a shared counter: the thread that takes an item runs through the
//       super-block's K blocks, for each packing the item's rows of A (MC x KC) into its own
//       buffer, where they stay in its L2, and computing the item's (MR x NR) tiles; beta
//       applies on the first K block only. Each tile is computed whole by one thread, in the
//       same order of K blocks, so results are the same for any thread count. Two barriers per
//       (jc, ps): after B is packed, and before it is packed again.
//
// P provides: In (stored element), Packed (4-byte packed element), KU (k values per packed
// element), MR, NR, KC (block sizes, KC a multiple of KU), kTuned (which kernel's blocking it
// takes from gemm_tuning.h: MC as row panels of MR, NC, the super-block's bytes), and
//   pack_a(Packed* dst, const In* A, lda, bool trans, i0, m, k0, kc): rows i0..i0+min(m, MR)
//       of op(A), columns k0..k0+kc, as ceil(kc / KU) x MR, zero-padded; m is the rows op(A)
//       has from i0 on, so that a packing routine knows how far it may read;
//   pack_b(Packed* dst, const In* B, ldb, bool trans, j0, n, k0, kc): columns j0..j0+min(n, NR)
//       of op(B) as ceil(kc / KU) x NR, zero-padded; n is the columns op(B) has from j0 on;
//   micro(kp, a, b, C, ldc, beta, m, n): C[0:m, 0:n] = a * b + beta C (beta 0: overwrite).
// A policy whose A micro-panels are not pair-major ([p][r]) declares kWholePanelsA = true, so
// the driver never packs A by ranges of K rows across micro-panels.
// C is FP32, or bf16 (uint16_t, where P's micro takes it): the product rounded once, which needs
// the whole K in one block (K <= KC) and beta 0.
//
// With a rank-r update (LowRankUpdate, bf16 operands and an FP32 C, r <= KC, not on the fused or
// direct path), C += U op(V) is added to each tile right after its last K block, while the tile
// is in L1: U and op(V) are packed once for the call, before the first B block, as the blocked
// path packs A and B (pack_a and pack_b over one K block of r), and each tile's update is P's
// micro over them with beta 1. That is the blocked path's own product U op(V) with beta 1 on C,
// tile by tile, so the bits are those of the two products one after the other.
//
// With a kept B (KeptB: an LM head's weight, shared by its chunks of rows), each (jc, K block)
// block of packed B has its own place in the caller's buffer instead of buffer 0: the first
// product packs every block there, and the products after it, which read the same B, skip the
// packing. The packed values are those buffer 0 would hold, so the bits are the same.
//
// Weight gradients may take the fused path (gemm_fused.h) or the direct one (gemm_direct.h)
// instead; blocked_plan (gemm_plan.h) says which.
#pragma once

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <type_traits>

#include "kernels/gemm/gemm_direct.h"
#include "kernels/gemm/gemm_fused.h"
#include "kernels/gemm/gemm_plan.h"

namespace cputrain::kernels::detail {

// Floats of buffer 2 that gemm_blocked<P> takes for a rank-r update's packed U (M x r) and op(V)
// (r x N): whole micro-panels of each.
template <class P>
int64_t low_rank_pack_floats(int64_t M, int64_t N, int64_t r) {
  const int64_t kp = (r + P::KU - 1) / P::KU;
  return ((M + P::MR - 1) / P::MR * P::MR + (N + P::NR - 1) / P::NR * P::NR) * kp;
}

// Floats of a kept B for N x K: every column micro-panel over all of K.
template <class P>
int64_t kept_b_floats(int64_t N, int64_t K) {
  return (N + P::NR - 1) / P::NR * P::NR * ((K + P::KU - 1) / P::KU);
}

template <class P, class CT>
void gemm_blocked(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K,
                  const typename P::In* A, int64_t lda, const typename P::In* B, int64_t ldb,
                  float beta, CT* C, int64_t ldc, const LowRankUpdate* update = nullptr,
                  KeptB* kept = nullptr) {
  constexpr bool kUpdates = std::is_same_v<typename P::In, uint16_t> && std::is_same_v<CT, float>;
  using Packed = typename P::Packed;
  static_assert(sizeof(Packed) == sizeof(float));
  if (M <= 0 || N <= 0) return;
  if constexpr (std::is_same_v<CT, float>) {
    if (K <= 0) return scale_c(C, M, N, ldc, beta);
  } else {
    if (K <= 0) {
      for (int64_t i = 0; i < M; ++i) std::fill(C + i * ldc, C + i * ldc + N, uint16_t{0});
      return;
    }
    if (K > P::KC || beta != 0.0f)
      throw std::logic_error("gemm_blocked: a bf16 C needs K <= KC and beta 0");
  }
  const bool at = ta == Transpose::Yes, bt = tb == Transpose::Yes;
  const bool a_by_rows = at && !whole_panels_a<P>();
  constexpr int64_t MR = P::MR, NR = P::NR, KU = P::KU;
  const BlockedPlan<P> plan = blocked_plan<P>(at, bt, M, N, K, std::is_same_v<CT, float>, lda, ldb,
                                              operands_start_lines(A, lda, B, ldb));
  if (update != nullptr &&
      (!kUpdates || plan.direct || plan.fused || update->r < 1 || update->r > P::KC))
    throw std::logic_error("gemm_blocked: a rank-r update on a path that does not add it");
  if (kept != nullptr && (plan.direct || plan.fused))
    throw std::logic_error("gemm_blocked: a kept B on a path that packs B its own way");
  if constexpr (direct_path<P>() && std::is_same_v<CT, float>) {
    if (plan.direct) return gemm_direct<P>(plan, M, N, K, A, lda, B, ldb, beta, C, ldc);
  }
  auto* bpack =
      reinterpret_cast<Packed*>(gemm_pack_buffer(static_cast<size_t>(plan.b_floats()), 0));
  auto* apack =
      reinterpret_cast<Packed*>(gemm_pack_buffer(static_cast<size_t>(plan.a_floats()), 1));
  if constexpr (fused_packing<P>() && std::is_same_v<CT, float>) {
    if (plan.fused) return gemm_fused<P>(plan, M, N, K, A, lda, B, ldb, beta, C, ldc, apack, bpack);
  }
  // The update's packed op(V) (every micro-panel of N, first: the micro-kernel loads B's
  // vectors aligned) and U (n_ir micro-panels).
  const int64_t n_jr_all = (N + NR - 1) / NR;
  const int64_t kp_update = update != nullptr ? (update->r + KU - 1) / KU : 0;
  Packed* const vpack = update != nullptr
                            ? reinterpret_cast<Packed*>(gemm_pack_buffer(
                                  static_cast<size_t>(low_rank_pack_floats<P>(M, N, update->r)), 2))
                            : nullptr;
  Packed* const upack = vpack + n_jr_all * kp_update * NR;
  const int64_t n_ir = plan.n_ir, ir_per_block = plan.ir_per_block;
  // Row blocks of ir_per_block micro-panels, and at the end, the last threads x 2 blocks' worth
  // in blocks of a quarter of that, so that the threads end closer together.
  const int64_t small_block = std::max<int64_t>(1, ir_per_block / 4);
  const int64_t head_blocks =
      std::max<int64_t>(0, n_ir - 2 * plan.threads * ir_per_block) / ir_per_block;
  const int64_t head_panels = head_blocks * ir_per_block;
  const int64_t row_blocks = head_blocks + (n_ir - head_panels + small_block - 1) / small_block;
  // Micro-panels ir0..ir1 of row block rb.
  const auto block_panels = [=](int64_t rb) {
    const int64_t ir0 =
        rb < head_blocks ? rb * ir_per_block : head_panels + (rb - head_blocks) * small_block;
    return std::pair<int64_t, int64_t>(
        ir0, std::min(n_ir, ir0 + (rb < head_blocks ? ir_per_block : small_block)));
  };
  const int64_t k_chunks_block = (P::KC + kPackRows - 1) / kPackRows;
  const bool a_rows_alias = rows_alias_in_l1(lda * static_cast<int64_t>(sizeof(typename P::In)));
  const int64_t a_pack_rows = a_rows_alias ? kPackRowsAliased : kPackRows;

  // The kept B's blocks: column block jc's start after jc columns of all of K, K block q after
  // q whole blocks of the column block's micro-panels (b_block_floats each; only the last block
  // is shorter). Packed again where it was packed with another nc (the plan of a smaller
  // product may take fewer threads; kept->packed_nc is the nc it was packed with).
  Packed* const kept_b = kept != nullptr ? static_cast<Packed*>(kept->data) : nullptr;
  const int64_t kp_all = (K + KU - 1) / KU;
  const bool packs_b = kept_b == nullptr || kept->packed_nc != plan.nc;

  std::atomic<int64_t> next_item{0};  // work items of every (jc, ps) block, numbered on

#pragma omp parallel num_threads(plan.threads)
  {
    const int nt = omp_get_num_threads();
    int64_t items_begin = 0;
    Packed* const my_a = apack + omp_get_thread_num() * plan.a_floats_per_thread();
    if constexpr (kUpdates) {
      if (update != nullptr) {
#pragma omp for schedule(static)
        for (int64_t item = 0; item < n_ir + n_jr_all; ++item) {
          if (item < n_ir)
            P::pack_a(upack + item * kp_update * MR, update->u, update->ldu, false, item * MR,
                      M - item * MR, 0, update->r);
          else
            P::pack_b(vpack + (item - n_ir) * kp_update * NR, update->v, update->ldv,
                      update->tv == Transpose::Yes, (item - n_ir) * NR, N - (item - n_ir) * NR, 0,
                      update->r);
        }
      }
    }
    for (int64_t jc = 0; jc < N; jc += plan.nc) {
      const int64_t nc = std::min<int64_t>(plan.nc, N - jc);
      const int64_t n_jr = (nc + NR - 1) / NR;
      const int64_t b_block_floats = plan.kp_block * n_jr * NR;  // one K block's B panels
      // Column groups only where there are too few row blocks to go round.
      int64_t col_groups = 1;
      while (row_blocks * col_groups < 4 * nt && col_groups < n_jr) ++col_groups;
      const int64_t jr_per_group = (n_jr + col_groups - 1) / col_groups;
      col_groups = (n_jr + jr_per_group - 1) / jr_per_group;
      for (int64_t ps = 0; ps < K; ps += plan.ks) {
        const int64_t ks = std::min(plan.ks, K - ps);
        const int64_t q_blocks = (ks + P::KC - 1) / P::KC;
        // The super-block's B, K block q at bpack + q * b_block_floats. Where stored rows run
        // along N (B not transposed), a thread packs a range of K rows across every
        // micro-panel, reading each row once from start to end; otherwise it packs whole
        // micro-panels. The same for A below, whose rows run along M when transposed.
        const int64_t b_items = bt ? n_jr : k_chunks_block;
        Packed* const b_blocks =
            kept_b != nullptr ? kept_b + jc * kp_all + ps / P::KC * b_block_floats : bpack;
        if (packs_b) {
#pragma omp for schedule(static)
          for (int64_t item = 0; item < q_blocks * b_items; ++item) {
            const int64_t q = item / b_items, pc = ps + q * P::KC;
            const int64_t kc = std::min<int64_t>(P::KC, K - pc), kp = (kc + KU - 1) / KU;
            const int64_t k0 = bt ? 0 : item % b_items * kPackRows;
            if (k0 >= kc) continue;
            const int64_t klen = bt ? kc : std::min<int64_t>(kPackRows, kc - k0);
            Packed* const block = b_blocks + q * b_block_floats;
            for (int64_t jr = bt ? item % b_items : 0; jr < (bt ? item % b_items + 1 : n_jr); ++jr)
              P::pack_b(block + jr * kp * NR + k0 / KU * NR, B, ldb, bt, jc + jr * NR,
                        N - jc - jr * NR, pc + k0, klen);
          }
        }
        // Each item runs over the super-block's K blocks, its rows of C staying in L2. Items
        // are handed out one ahead, so that a thread fetches the transposed A it packs next
        // while it computes: a stretch of each of KC rows, read down a column, which the
        // hardware prefetcher would not follow. (A stored (M, K) is read along its rows, a few
        // at a time, and is left to pack_a's own fetches: fetched into L2 ahead as well, it
        // takes the place of packed B there. Not where a transposed A's rows alias in L1, and
        // so in a few sets of L2 as well, which cannot hold an item's rows: there the fetch only
        // evicts them again.)
        const int64_t items_end = items_begin + row_blocks * col_groups;
        const auto a_rows = [&](int64_t item, int64_t steps) {
          const auto [p0, p1] = block_panels((item - items_begin) / col_groups);
          const int64_t i0 = p0 * MR;
          const int64_t m = std::min(M, p1 * MR) - i0;
          const int64_t kc = std::min<int64_t>(P::KC, K - ps);
          constexpr int64_t es = sizeof(typename P::In);
          return RowsPrefetch(A + ps * lda + i0, kc, m * es, lda * es, steps);
        };
        int64_t item = claim_item(next_item, items_end);
        while (item < items_end) {
          const int64_t next = claim_item(next_item, items_end);
          const int64_t rb = (item - items_begin) / col_groups,
                        cg = (item - items_begin) % col_groups;
          const auto [ir0, ir1] = block_panels(rb);
          const int64_t jr0 = cg * jr_per_group, jr1 = std::min(n_jr, jr0 + jr_per_group);
          for (int64_t q = 0; q < q_blocks; ++q) {
            const int64_t pc = ps + q * P::KC;
            const int64_t kc = std::min<int64_t>(P::KC, K - pc), kp = (kc + KU - 1) / KU;
            const float beta_block = pc == 0 ? beta : 1.0f;
            const int64_t steps = (ir1 - ir0) * (jr1 - jr0);
            RowsPrefetch ahead;
            if (at && !a_rows_alias && next < items_end)
              ahead = a_rows(next, steps);  // q_blocks is 1 here
            for (int64_t k0 = 0; k0 < (a_by_rows ? kc : 1); k0 += a_pack_rows) {
              const int64_t klen = a_by_rows ? std::min<int64_t>(a_pack_rows, kc - k0) : kc;
              for (int64_t ir = ir0; ir < ir1; ++ir)
                P::pack_a(my_a + (ir - ir0) * kp * MR + k0 / KU * MR, A, lda, at, ir * MR,
                          M - ir * MR, pc + k0, klen);
            }
            const Packed* const block = b_blocks + q * b_block_floats;
            // The A micro-panel stays in L1 while B micro-panels stream from L2 and L3.
            for (int64_t ir = ir0; ir < ir1; ++ir) {
              const int64_t i = ir * MR;
              const int m = static_cast<int>(std::min<int64_t>(MR, M - i));
              for (int64_t jr = jr0; jr < jr1; ++jr) {
                const int64_t j = jc + jr * NR;
                const int n = static_cast<int>(std::min<int64_t>(NR, N - j));
                P::micro(kp, my_a + (ir - ir0) * kp * MR, block + jr * kp * NR, C + i * ldc + j,
                         ldc, beta_block, m, n);
                if constexpr (kUpdates) {
                  if (update != nullptr && pc + kc == K)
                    P::micro(kp_update, upack + ir * kp_update * MR,
                             vpack + j / NR * kp_update * NR, C + i * ldc + j, ldc, 1.0f, m, n);
                }
                ahead.step();
              }
            }
          }
          item = next;
        }
        items_begin = items_end;
        // (A kept B's blocks stay: there only before the next super-block adds to the same
        // tiles of C.)
        if (kept_b == nullptr || ps + plan.ks < K) {
#pragma omp barrier
        }
      }
    }
  }
  if (kept_b != nullptr) kept->packed_nc = plan.nc;
}

}  // namespace cputrain::kernels::detail
