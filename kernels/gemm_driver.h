// The blocked GEMM driver (after BLIS): five loops around a register-blocked micro-kernel, over
// panels of A and B packed for it. Only the packing and the micro-kernel differ per data type and
// ISA; they come in a policy P, and this header is included by each ISA's file so that the whole
// driver is compiled with that ISA's flags.
//
//   for jc in N by NC            B panel (KC x NC) packed once, shared by the threads
//     for pc in K by KC          beta applies on the first K block only
//       for mb in M by MB        A block (MB x KC) packed once, shared
//         threads split the (MR x NR) tiles: by blocks of MC rows, and if there are too few,
//         by groups of NR columns as well; each tile is computed by one thread, so results
//         are the same for any thread count.
//
// P provides: In (stored element), Packed (4-byte packed element), KU (k values per packed
// element), MR, NR, KC, MC, NC, MB (block sizes, KC a multiple of KU), and
//   pack_a(Packed* dst, const In* A, lda, bool trans, i0, m, k0, kc): rows i0..i0+m (m <= MR) of
//       op(A), columns k0..k0+kc, as ceil(kc / KU) x MR, zero-padded;
//   pack_b(Packed* dst, const In* B, ldb, bool trans, j0, n, k0, kc): columns j0..j0+n of op(B)
//       as ceil(kc / KU) x NR, zero-padded;
//   micro(kp, a, b, C, ldc, beta, m, n): C[0:m, 0:n] = a * b + beta C (beta 0: overwrite).
// A policy whose A micro-panels are not pair-major ([p][r]) declares kWholePanelsA = true, so
// the driver never packs A by ranges of K rows across micro-panels.
// C is FP32, or bf16 (uint16_t, where P's micro takes it): the product rounded once, which needs
// the whole K in one block (K <= KC) and beta 0.
#pragma once

#include <omp.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <stdexcept>
#include <type_traits>

#include "kernels/gemm_isa.h"

namespace cputrain::kernels::detail {

// Buffers of the calling thread, grown on demand and kept for the next call: `which` 0 and 1
// are the blocked driver's packed panels, 2 and 3 the FP32 widenings of bf16 operands.
float* gemm_pack_buffer(size_t floats, int which);

// K rows per packing item where rows are packed across micro-panels (a multiple of 2 = KU).
constexpr int64_t kPackRows = 16;

// P::kWholePanelsA where P declares it, else false.
template <class P>
constexpr bool whole_panels_a() {
  if constexpr (requires { P::kWholePanelsA; })
    return P::kWholePanelsA;
  else
    return false;
}

// Floats gemm_blocked<P> takes of buffers 0 (B panels) and 1 (A panels) for an M x N x K
// product with M, N, K > 0.
template <class P>
std::array<int64_t, 2> blocked_pack_floats(int64_t M, int64_t N, int64_t K) {
  const int64_t nc_max = std::min<int64_t>(P::NC, (N + P::NR - 1) / P::NR * P::NR);
  const int64_t mb_max = std::min<int64_t>(P::MB, (M + P::MR - 1) / P::MR * P::MR);
  const int64_t kp_max = (std::min<int64_t>(P::KC, K) + P::KU - 1) / P::KU;
  return {kp_max * nc_max, kp_max * mb_max};
}

template <class P, class CT>
void gemm_blocked(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K,
                  const typename P::In* A, int64_t lda, const typename P::In* B, int64_t ldb,
                  float beta, CT* C, int64_t ldc) {
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
  const auto floats = blocked_pack_floats<P>(M, N, K);
  auto* bpack = reinterpret_cast<Packed*>(gemm_pack_buffer(static_cast<size_t>(floats[0]), 0));
  auto* apack = reinterpret_cast<Packed*>(gemm_pack_buffer(static_cast<size_t>(floats[1]), 1));
  const double flops = 2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K);
  const int threads = flops < 2e6 ? 1 : omp_get_max_threads();

#pragma omp parallel num_threads(threads)
  {
    const int nt = omp_get_num_threads();
    for (int64_t jc = 0; jc < N; jc += P::NC) {
      const int64_t nc = std::min<int64_t>(P::NC, N - jc);
      const int64_t n_jr = (nc + NR - 1) / NR;
      for (int64_t pc = 0; pc < K; pc += P::KC) {
        const int64_t kc = std::min<int64_t>(P::KC, K - pc);
        const int64_t kp = (kc + KU - 1) / KU;
        const float beta_block = pc == 0 ? beta : 1.0f;
        // Where stored rows run along N (B not transposed), a thread packs a range of K rows
        // across every micro-panel, reading each row once from start to end; otherwise it packs
        // whole micro-panels. The same for A below, whose rows run along M when transposed.
        const int64_t k_chunks = (kc + kPackRows - 1) / kPackRows;
#pragma omp for schedule(static)
        for (int64_t item = 0; item < (bt ? n_jr : k_chunks); ++item) {
          const int64_t k0 = bt ? 0 : item * kPackRows;
          const int64_t klen = bt ? kc : std::min<int64_t>(kPackRows, kc - k0);
          for (int64_t jr = bt ? item : 0; jr < (bt ? item + 1 : n_jr); ++jr)
            P::pack_b(bpack + jr * kp * NR + k0 / KU * NR, B, ldb, bt, jc + jr * NR,
                      std::min<int64_t>(NR, nc - jr * NR), pc + k0, klen);
        }
        for (int64_t mb = 0; mb < M; mb += P::MB) {
          const int64_t mbn = std::min<int64_t>(P::MB, M - mb);
          const int64_t n_ir = (mbn + MR - 1) / MR;
#pragma omp for schedule(static)
          for (int64_t item = 0; item < (a_by_rows ? k_chunks : n_ir); ++item) {
            const int64_t k0 = a_by_rows ? item * kPackRows : 0;
            const int64_t klen = a_by_rows ? std::min<int64_t>(kPackRows, kc - k0) : kc;
            for (int64_t ir = a_by_rows ? 0 : item; ir < (a_by_rows ? n_ir : item + 1); ++ir)
              P::pack_a(apack + ir * kp * MR + k0 / KU * MR, A, lda, at, mb + ir * MR,
                        std::min<int64_t>(MR, mbn - ir * MR), pc + k0, klen);
          }
          // Work items: (block of MC rows) x (group of NR-column micro-panels).
          // Blocks of up to MC rows, smaller when there are too few rows to go round; handed
          // out dynamically, since blocks differ in size (results do not: each tile is still
          // computed whole by one thread).
          const int64_t ir_per_block = std::clamp<int64_t>(n_ir / (8 * nt), 1, P::MC / MR);
          const int64_t row_blocks = (n_ir + ir_per_block - 1) / ir_per_block;
          int64_t col_groups = 1;
          while (row_blocks * col_groups < 4 * nt && col_groups < n_jr) ++col_groups;
          const int64_t jr_per_group = (n_jr + col_groups - 1) / col_groups;
          col_groups = (n_jr + jr_per_group - 1) / jr_per_group;
#pragma omp for schedule(dynamic, 1)
          for (int64_t item = 0; item < row_blocks * col_groups; ++item) {
            const int64_t rb = item / col_groups, cg = item % col_groups;
            const int64_t ir0 = rb * ir_per_block, ir1 = std::min(n_ir, ir0 + ir_per_block);
            const int64_t jr0 = cg * jr_per_group, jr1 = std::min(n_jr, jr0 + jr_per_group);
            // The A micro-panel stays in L1 while B micro-panels stream from L2.
            for (int64_t ir = ir0; ir < ir1; ++ir) {
              const int64_t i = mb + ir * MR;
              const int m = static_cast<int>(std::min<int64_t>(MR, M - i));
              for (int64_t jr = jr0; jr < jr1; ++jr) {
                const int64_t j = jc + jr * NR;
                const int n = static_cast<int>(std::min<int64_t>(NR, N - j));
                P::micro(kp, apack + ir * kp * MR, bpack + jr * kp * NR, C + i * ldc + j, ldc,
                         beta_block, m, n);
              }
            }
          }
        }
      }
    }
  }
}

}  // namespace cputrain::kernels::detail
