// How the blocked GEMM (gemm_blocked.h) splits a product and which of its paths a product
// takes (BlockedPlan), the policy traits the paths probe, and helpers the paths share: the
// calling thread's buffers, fetching rows ahead, claiming work items.
#pragma once

#include <omp.h>
#include <xmmintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <stdexcept>
#include <thread>
#include <type_traits>
#include <utility>

#include "kernels/cpu/cpu_features.h"
#include "kernels/gemm/gemm_isa.h"
#include "kernels/gemm/gemm_tuning.h"

namespace cputrain::kernels::detail {

// Buffers of the calling thread, grown on demand and kept for the next call: `which` 0 and 1
// are the blocked driver's packed panels, 2 and 3 the FP32 widenings of bf16 operands, 4 the
// quantised products' dequantised panel of W (kGemmQuantPanel, kernels/gemm/gemm.h).
float* gemm_pack_buffer(size_t floats, int which);

// K rows per packing item where rows are packed across micro-panels (a multiple of 2 = KU).
constexpr int64_t kPackRows = 16;

// Stored rows whose stride is a multiple of L1's way size (its size over its ways: 4 KiB on the
// x86 cores we target) have their lines at a column all in one L1 set, which holds only a few of
// them (8 on Zen 4): an LM head's gradient, whose rows are 32 or 64 KiB apart, read down a column.
inline bool rows_alias_in_l1(int64_t stride_bytes) {
  static const int64_t way = cpu_caches().l1d_way;
  return stride_bytes % way == 0;
}

// Whether every row of an operand at p, stride_bytes apart, starts a 64-byte cache line (a
// training step's tensors do).
inline bool rows_start_lines(const void* p, int64_t stride_bytes) {
  return reinterpret_cast<uintptr_t>(p) % 64 == 0 && stride_bytes % 64 == 0;
}

// Whether every row of both operands, lda and ldb elements apart, starts a cache line.
template <class In>
bool operands_start_lines(const In* A, int64_t lda, const In* B, int64_t ldb) {
  constexpr int64_t bytes = sizeof(In);
  return rows_start_lines(A, lda * bytes) && rows_start_lines(B, ldb * bytes);
}

// kPackRows for a transposed A whose rows alias in L1: the rows being packed stay in L1 while
// each of an item's micro-panels takes its columns of them.
constexpr int64_t kPackRowsAliased = 4;

// P::kWholePanelsA where P declares it, else false.
template <class P>
constexpr bool whole_panels_a() {
  if constexpr (requires { P::kWholePanelsA; })
    return P::kWholePanelsA;
  else
    return false;
}

// P::kFusedPacking where P declares it, else false.
template <class P>
constexpr bool fused_packing() {
  if constexpr (requires { P::kFusedPacking; })
    return P::kFusedPacking;
  else
    return false;
}

// P::kFusedSharedA where P declares it, else false.
template <class P>
constexpr bool fused_shared_a() {
  if constexpr (requires { P::kFusedSharedA; })
    return P::kFusedSharedA;
  else
    return false;
}

// P::kDirect where P declares it, else false.
template <class P>
constexpr bool direct_path() {
  if constexpr (requires { P::kDirect; })
    return P::kDirect;
  else
    return false;
}

// The threads a product of M x N x K runs on: one below 2 MFLOP or where the calling thread's
// products run on it alone (gemm_serial), else all of OpenMP's.
inline int blocked_threads(int64_t M, int64_t N, int64_t K) {
  const double flops =
      2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K);
  return flops < 2e6 || gemm_serial() ? 1 : omp_get_max_threads();
}

// How gemm_blocked<P> splits an M x N x K product (M, N, K > 0).
template <class P>
struct BlockedPlan {
  int threads;
  int64_t n_ir;          // micro-panels of MR rows over M
  int64_t ir_per_block;  // micro-panels per row block (a work item's rows)
  int64_t nc;            // columns per B block (the tuning's nc)
  int64_t nc_max;        // columns of the widest B block
  int64_t kc_block;      // K rows per K block: KC, or gemm_fused_k_blocks() x KC when fused
  int64_t kp_block;      // packed K steps of a K block (kc_block / KU, or fewer for a small K)
  int64_t ks;            // K per super-block: whole K blocks of KC, or all of K
  bool direct;           // the direct path: a thread's rows, nothing packed
  bool fused;            // the fused path: a thread's columns, packing inside the products
  bool shared_a;         // on the fused path, A packed once for all threads, a share each
  int64_t fused_panels;  // B micro-panels per thread packed at a time on the fused path
  int64_t b_floats() const {
    if (direct) return 0;
    return fused ? threads * kp_block * fused_panels * P::NR
                 : (ks + P::KC - 1) / P::KC * kp_block * nc_max;
  }
  int64_t a_floats_per_thread() const {
    return direct ? 0 : kp_block * (fused ? 1 : ir_per_block) * P::MR;
  }
  // Buffer 1: the shared A of two K blocks where A is shared, then every thread's A rows.
  int64_t a_floats() const {
    return (shared_a ? 2 * n_ir * kp_block * P::MR : 0) + threads * a_floats_per_thread();
  }
};

// lda and ldb: the operands' strides in elements, 0 for contiguous ones (a training step's);
// lines: whether every row of both starts a cache line (rows_start_lines).
template <class P>
BlockedPlan<P> blocked_plan(bool a_transposed, bool b_transposed, int64_t M, int64_t N, int64_t K,
                            bool c_fp32 = true, int64_t lda = 0, int64_t ldb = 0,
                            bool lines = true) {
  BlockedPlan<P> plan;
  plan.threads = blocked_threads(M, N, K);
  // The blocking that does not change results (kernels/gemm/gemm_tuning.h), for this thread count.
  const GemmTuning tuning = gemm_tuning(P::kTuned, plan.threads);
  // The fused path where each thread has 4 micro-panels of columns or more, and where P finds
  // it suits the shape: every thread reads all of A there, which costs more than the packing
  // phase it saves where A has many more rows than B has columns (an LM head's weight
  // gradient).
  // The direct path before it where P finds it suits the shape, each thread has a row block of
  // rows or more, and neither operand's rows alias in L1 (gemm_fused() governs both,
  // gemm_direct() the direct path). Rows a multiple of 4 KiB apart fall in one set of L1 and
  // in a sixteenth of L2's, which hold fewer of them than a K block has: the rows fetched ahead
  // are evicted before they are read. Rows that do not start a cache line have some of A's
  // values a K step broadcasts in two lines and each of B's vectors across two. Both run slower
  // on the direct path than on the fused one.
  const int64_t n_jr = (N + P::NR - 1) / P::NR;
  const bool weight_gradient = c_fp32 && a_transposed && !b_transposed && gemm_fused();
  if constexpr (direct_path<P>())
    plan.direct =
        weight_gradient && gemm_direct() && lines &&
        M >= plan.threads * P::kDirectRowPanels * P::kDirectMR && P::direct_suits(M, N, K) &&
        !rows_alias_in_l1((lda > 0 ? lda : M) * static_cast<int64_t>(sizeof(typename P::In))) &&
        !rows_alias_in_l1((ldb > 0 ? ldb : N) * static_cast<int64_t>(sizeof(typename P::In)));
  else
    plan.direct = false;
  if constexpr (fused_packing<P>())
    plan.fused =
        weight_gradient && !plan.direct && n_jr >= 4 * plan.threads && P::fused_suits(M, N, K);
  else
    plan.fused = false;
  plan.fused_panels = std::min(tuning.fused_panels, (n_jr + plan.threads - 1) / plan.threads);
  plan.n_ir = (M + P::MR - 1) / P::MR;
  // Blocks of up to MC rows, smaller when there are too few rows to go round.
  plan.ir_per_block = std::clamp<int64_t>(plan.n_ir / (8 * plan.threads), 1, tuning.row_panels);
  // A multiple of 128 columns is whole micro-panels (NR divides 128).
  static_assert(128 % P::NR == 0);
  plan.nc = tuning.nc;
  plan.nc_max = std::min<int64_t>(plan.nc, (N + P::NR - 1) / P::NR * P::NR);
  plan.kc_block = plan.fused ? tuning.fused_k_blocks * P::KC : P::KC;
  plan.kp_block = (std::min<int64_t>(plan.kc_block, K) + P::KU - 1) / P::KU;
  // A packed once for all threads where P asks for it, every thread has one group of columns
  // (so that all run through the K blocks in the same order) and a thread's B block is larger
  // than L2 (1 MiB on the cores we target): there A's rows, fetched ahead into L2, are evicted
  // by B's before they are packed, and packing each once instead of on every thread pays. Where
  // B's block fits, it does not, and it is not taken. (The tuning's shared_a_kib: L2's size.)
  plan.shared_a = fused_shared_a<P>() && plan.fused && plan.threads > 1 &&
                  plan.fused_panels * plan.threads >= n_jr &&
                  plan.kp_block * plan.fused_panels * P::NR * 4 > tuning.shared_a_kib * 1024;
  // Where A's rows run along K, an item reads one stretch of each row over a super-block's K
  // blocks, and its rows of C stay in L2 between them instead of going back to memory. A
  // transposed A (a weight gradient's, whose K is the tokens) would be read across thousands of
  // rows, a page each, by every item: one K block at a time there.
  const int64_t block_bytes = plan.kp_block * plan.nc_max * 4;
  // (Packed B of a super-block is read from L3 by every thread: the tuning's super_block_kib.)
  const int64_t blocks =
      a_transposed ? 1 : std::max<int64_t>(1, tuning.super_block_kib * 1024 / block_bytes);
  plan.ks = std::min(K, blocks * P::KC);
  return plan;
}

// Floats gemm_blocked<P> takes of buffers 0 (a B super-block) and 1 (every thread's A rows) for
// an M x N x K product with M, N, K > 0.
template <class P>
std::array<int64_t, 2> blocked_pack_floats(Transpose ta, Transpose tb, int64_t M, int64_t N,
                                           int64_t K) {
  const BlockedPlan<P> plan = blocked_plan<P>(ta == Transpose::Yes, tb == Transpose::Yes, M, N, K);
  return {plan.b_floats(), plan.a_floats()};
}

// Whether gemm_blocked<P> takes the fused path for an M x N x K product with an FP32 C.
template <class P>
bool takes_fused_path(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K) {
  return M > 0 && N > 0 && K > 0 &&
         blocked_plan<P>(ta == Transpose::Yes, tb == Transpose::Yes, M, N, K).fused;
}

// Whether gemm_blocked<P> takes the direct path for an M x N x K product with an FP32 C, of
// operands whose rows start cache lines (lines) lda and ldb apart (0: contiguous).
template <class P>
bool takes_direct_path(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K, int64_t lda = 0,
                       int64_t ldb = 0, bool lines = true) {
  return M > 0 && N > 0 && K > 0 &&
         blocked_plan<P>(ta == Transpose::Yes, tb == Transpose::Yes, M, N, K, true, lda, ldb, lines)
             .direct;
}

// `rows` stored rows of `row_bytes` bytes, `stride` bytes apart, fetched into L2 a few cache
// lines per step: the rows of a transposed A a thread packs next, fetched while it computes.
// (Read at a stride from L3 or memory only when packed, they arrive at a fraction of the rate
// the packing could take them.)
struct RowsPrefetch {
  const char* base = nullptr;
  int64_t rows = 0, row_bytes = 0, stride = 0, lines_per_step = 0;
  int64_t row = 0, offset = 0;

  RowsPrefetch() = default;
  RowsPrefetch(const void* base_, int64_t rows_, int64_t row_bytes_, int64_t stride_, int64_t steps)
      : base(static_cast<const char*>(base_)),
        rows(rows_),
        row_bytes(row_bytes_),
        stride(stride_),
        lines_per_step((rows_ * ((row_bytes_ + 63) / 64 + 1) + steps - 1) /
                       std::max<int64_t>(1, steps)) {}
  void step() {
    for (int64_t l = 0; l < lines_per_step && row < rows; ++l) {
      _mm_prefetch(base + row * stride + offset, _MM_HINT_T1);
      offset += 64;
      if (offset >= row_bytes + 64) {
        offset = 0;
        ++row;
      }
    }
  }
};

// The next item of [*, end) from a shared counter, or end when none is left; the counter never
// passes end.
inline int64_t claim_item(std::atomic<int64_t>& counter, int64_t end) {
  int64_t v = counter.load(std::memory_order_relaxed);
  while (v < end && !counter.compare_exchange_weak(v, v + 1, std::memory_order_relaxed)) {
  }
  return v;
}

}  // namespace cputrain::kernels::detail
