// The blocked GEMM driver (after BLIS): loops around a register-blocked micro-kernel, over panels
// of A and B packed for it. Only the packing and the micro-kernel differ per data type and ISA;
// they come in a policy P, and this header is included by each ISA's file so that the whole
// driver is compiled with that ISA's flags.
//
//   for jc in N by NC            columns of C
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
// element), MR, NR, KC, MC, NC (block sizes, KC a multiple of KU), and
//   pack_a(Packed* dst, const In* A, lda, bool trans, i0, m, k0, kc): rows i0..i0+min(m, MR)
//       of op(A), columns k0..k0+kc, as ceil(kc / KU) x MR, zero-padded; m is the rows op(A)
//       has from i0 on, so that a packing routine knows how far it may read;
//   pack_b(Packed* dst, const In* B, ldb, bool trans, j0, n, k0, kc): columns j0..j0+min(n, NR)
//       of op(B) as ceil(kc / KU) x NR, zero-padded; n is the columns op(B) has from j0 on;
//   micro(kp, a, b, C, ldc, beta, m, n): C[0:m, 0:n] = a * b + beta C (beta 0: overwrite).
// A policy whose A micro-panels are not pair-major ([p][r]) declares kWholePanelsA = true, so
// the driver never packs A by ranges of K rows across micro-panels.
//
// A weight gradient's product (A transposed and B not: both stored with K along the rows) takes
// another path where P declares kFusedPacking, says in fused_suits(M, N, K) which shapes take it,
// and provides
//   micro_fused_t<pack_a, pack_b>(kc, a_src, lda, a_pack, b_src, ldb, b_pack, C, ldc, beta, m,
//                                 n, next_a, next_rows):
//       micro's product over kc K rows (ceil(kc / KU) packed steps, up to gemm_fused_k_blocks()
//       x KC; the tile stored into C after each KC of them, as one product per K block of KC
//       would store it), reading A's rows i..i+min(m, MR) and B's columns j..j+min(n, NR)
//       straight from the matrices where pack_a / pack_b, and storing them packed as it goes,
//       else reading the packed copies (m and n: the rows and columns op(A) and op(B) have from
//       i and j on); meanwhile it fetches into L2 next_rows K rows of MR values of A, lda apart
//       from next_a (a share of the rows the next row of C packs);
// each thread takes its own range of B micro-panels (columns of C) and runs, per K block of
// gemm_fused_k_blocks() x KC, over every row of C: the first micro-panel of a row packs that
// row's A, the first row packs each B micro-panel. The packing runs inside the products, with
// no barrier at all. The rows of a thread's last K block are shared: once its row 0 has packed
// that block's B, a thread that has finished its own columns takes rows from the back
// (FusedShare), so that the threads end together. Where P declares kFusedSharedA and a
// thread's B block is larger than L2 (blocked_plan), A is packed once for all threads instead:
// a row's packed A goes to a shared slot (one per row, two K blocks' worth) by whichever thread
// claims the row first (SharedA: a tag per row, set by compare-and-swap), and others read it
// from there once it is marked ready, or pack their own copy where it is not (so no thread ever
// waits on another). Each thread starts its rows at its own share of them and goes round, so
// that it mostly packs its share and reads the rest. Each tile sees its K blocks in order, from
// the same packed operands, whichever thread computes the last, so results are the same for any
// thread count here too, and the same as the blocked path's.
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
// C is FP32, or bf16 (uint16_t, where P's micro takes it): the product rounded once, which needs
// the whole K in one block (K <= KC) and beta 0.
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

#include "kernels/gemm_isa.h"

namespace cputrain::kernels::detail {

// Buffers of the calling thread, grown on demand and kept for the next call: `which` 0 and 1
// are the blocked driver's packed panels, 2 and 3 the FP32 widenings of bf16 operands.
float* gemm_pack_buffer(size_t floats, int which);

// K rows per packing item where rows are packed across micro-panels (a multiple of 2 = KU).
constexpr int64_t kPackRows = 16;

// Stored rows whose stride is a multiple of L1's way size (4 KiB on the x86 cores we target)
// have their lines at a column all in one L1 set, which holds only a few of them (8 on Zen 4):
// an LM head's gradient, whose rows are 32 or 64 KiB apart, read down a column.
inline bool rows_alias_in_l1(int64_t stride_bytes) {
  return stride_bytes % 4096 == 0;
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

// B micro-panels of a thread's columns packed at a time on the fused path. A is read again for
// each group, so groups are wide: 24 x 32 columns, 3 MiB of packed FP32 B at K blocks of 1024,
// which is read from L2 and L3 well enough.
constexpr int64_t kFusedPanels = 24;

// The threads a product of M x N x K runs on: one below 2 MFLOP, else all of OpenMP's.
inline int blocked_threads(int64_t M, int64_t N, int64_t K) {
  const double flops =
      2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K);
  return flops < 2e6 ? 1 : omp_get_max_threads();
}

// Bytes of a thread's packed B block on the fused path past which A is packed once for all
// threads (where the policy allows it): L2's size on the cores we target.
constexpr int64_t kSharedABBytes = 1 << 20;

// Bytes of packed B a super-block may take: it is read from L3 by both threads.
constexpr int64_t kSuperBlockBytes = 4 << 20;

// How gemm_blocked<P> splits an M x N x K product (M, N, K > 0).
template <class P>
struct BlockedPlan {
  int threads;
  int64_t n_ir;          // micro-panels of MR rows over M
  int64_t ir_per_block;  // micro-panels per row block (a work item's rows)
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
  plan.fused_panels = std::min(kFusedPanels, (n_jr + plan.threads - 1) / plan.threads);
  plan.n_ir = (M + P::MR - 1) / P::MR;
  // Blocks of up to MC rows, smaller when there are too few rows to go round.
  plan.ir_per_block = std::clamp<int64_t>(plan.n_ir / (8 * plan.threads), 1, P::MC / P::MR);
  plan.nc_max = std::min<int64_t>(P::NC, (N + P::NR - 1) / P::NR * P::NR);
  plan.kc_block = plan.fused ? gemm_fused_k_blocks() * P::KC : P::KC;
  plan.kp_block = (std::min<int64_t>(plan.kc_block, K) + P::KU - 1) / P::KU;
  // A packed once for all threads where P asks for it, every thread has one group of columns
  // (so that all run through the K blocks in the same order) and a thread's B block is larger
  // than L2 (1 MiB on the cores we target): there A's rows, fetched ahead into L2, are evicted
  // by B's before they are packed, and packing each once instead of on every thread pays. Where
  // B's block fits, it does not, and it is not taken.
  plan.shared_a = fused_shared_a<P>() && plan.fused && plan.threads > 1 &&
                  plan.fused_panels * plan.threads >= n_jr &&
                  plan.kp_block * plan.fused_panels * P::NR * 4 > kSharedABBytes;
  // Where A's rows run along K, an item reads one stretch of each row over a super-block's K
  // blocks, and its rows of C stay in L2 between them instead of going back to memory. A
  // transposed A (a weight gradient's, whose K is the tokens) would be read across thousands of
  // rows, a page each, by every item: one K block at a time there.
  const int64_t block_bytes = plan.kp_block * plan.nc_max * 4;
  const int64_t blocks = a_transposed ? 1 : std::max<int64_t>(1, kSuperBlockBytes / block_bytes);
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

// P::micro_fused_t<pack_a, pack_b>(args...), the flags made template arguments.
template <class P, class... Args>
inline void micro_fused(bool pack_a, bool pack_b, Args... args) {
  if (pack_a && pack_b) return P::template micro_fused_t<true, true>(args...);
  if (pack_a) return P::template micro_fused_t<true, false>(args...);
  if (pack_b) return P::template micro_fused_t<false, true>(args...);
  P::template micro_fused_t<false, false>(args...);
}

// Rows of C shared on the fused path: the rows of a thread's last K block (of its last group
// of columns) that are left, taken one at a time from the front by the thread itself and from
// the back by threads that have finished their own, so that a thread slowed down (by another
// tenant of its core, say) is helped rather than waited for. `rows` holds front << 32 | back;
// the others are set before `ready` is.
struct alignas(64) FusedShare {
  std::atomic<uint64_t> rows{0};
  std::atomic<int> ready{0};  // B of the K block packed, rows open
  int64_t jc = 0, jc_end = 0, pc = 0;
  int64_t first = 0;  // the row at position 0 (positions run round from it)
};

// The next row of `share` from the front (its owner) or the back (another thread), or -1 when
// none is left.
inline int64_t take_fused_row(FusedShare& share, bool front) {
  uint64_t v = share.rows.load(std::memory_order_relaxed);
  for (;;) {
    const uint64_t f = v >> 32, b = v & 0xffffffffu;
    if (f >= b) return -1;
    const uint64_t next = front ? (f + 1) << 32 | b : f << 32 | (b - 1);
    if (share.rows.compare_exchange_weak(v, next, std::memory_order_relaxed))
      return static_cast<int64_t>(front ? f : b - 1);
  }
}

// The calling thread's FusedShare for each of `threads` threads, reset, kept from call to call
// (no allocation in a training step after the first).
inline FusedShare* fused_shares(int threads) {
  thread_local std::unique_ptr<FusedShare[]> shares;
  thread_local int size = 0;
  if (size < threads) {
    shares.reset(new FusedShare[threads]);
    size = threads;
  }
  for (int t = 0; t < threads; ++t) {
    shares[t].rows.store(0, std::memory_order_relaxed);
    shares[t].ready.store(0, std::memory_order_relaxed);
  }
  return shares.get();
}

// Rows of C computed on the fused path by a thread other than their columns' (counted for the
// tests, which check that the sharing is reached).
extern std::atomic<int64_t> fused_rows_shared;

// A thread's current K block on the fused path where A is shared, on a cache line of its own.
struct alignas(64) ThreadBlock {
  std::atomic<uint64_t> block{0};
};

// Where A is shared on the fused path: for each row of C, the K block whose packed A its slot
// holds, and whether it is ready, as 2 block + 2 (being packed) or 2 block + 3 (ready); 0 before
// the first. A row's tag only grows. Beside them each thread's current K block: a slot is
// refilled only once every thread has left the K block before the one it holds.
struct SharedA {
  std::unique_ptr<std::atomic<uint64_t>[]> rows;
  std::unique_ptr<ThreadBlock[]> blocks;
  int64_t n_rows = 0, n_threads = 0;
};

// The calling thread's SharedA for n_ir rows and `threads` threads, reset, kept from call to
// call.
inline SharedA& shared_a_state(int64_t n_ir, int threads) {
  thread_local SharedA state;
  if (state.n_rows < n_ir) {
    state.rows.reset(new std::atomic<uint64_t>[n_ir]);
    state.n_rows = n_ir;
  }
  if (state.n_threads < threads) {
    state.blocks.reset(new ThreadBlock[threads]);
    state.n_threads = threads;
  }
  for (int64_t r = 0; r < n_ir; ++r) state.rows[r].store(0, std::memory_order_relaxed);
  for (int t = 0; t < threads; ++t) state.blocks[t].block.store(0, std::memory_order_relaxed);
  return state;
}

// Rows of C computed on the fused path from the shared copy of their packed A, not packing it
// (counted for the tests, which check that the sharing is reached).
extern std::atomic<int64_t> fused_rows_a_shared;

// The fused path (see the top of this file): C (FP32) = op(A) op(B) + beta C with A and B both
// stored (K, *), into buffers laid out by `plan`.
template <class P>
void gemm_fused(const BlockedPlan<P>& plan, int64_t M, int64_t N, int64_t K,
                const typename P::In* A, int64_t lda, const typename P::In* B, int64_t ldb,
                float beta, float* C, int64_t ldc, typename P::Packed* apack,
                typename P::Packed* bpack) {
  using Packed = typename P::Packed;
  const int64_t kc_block = plan.kc_block;
  constexpr int64_t MR = P::MR, NR = P::NR, KU = P::KU;
  const int64_t n_ir = plan.n_ir, n_jr = (N + NR - 1) / NR;
  FusedShare* const shares = fused_shares(plan.threads);
  SharedA* const shared = plan.shared_a ? &shared_a_state(n_ir, plan.threads) : nullptr;
  const auto b_of = [&](int64_t thread) {
    return bpack + thread * plan.kp_block * plan.fused_panels * NR;
  };
  Packed* const a_private = apack + (plan.shared_a ? 2 * n_ir * plan.kp_block * MR : 0);
  // Row ir's packed A of the K block at pc in the shared slots.
  const auto shared_a_of = [&](int64_t pc, int64_t ir) {
    return apack + ((pc / kc_block) % 2 * n_ir + ir) * plan.kp_block * MR;
  };
  // The row at position pos of a thread whose positions start at row `first` and go round.
  const auto row_at = [n_ir](int64_t first, int64_t pos) { return (first + pos) % n_ir; };
  // The K block a thread is in, and the oldest any thread is in.
  const auto enter_block = [&](int64_t t, int64_t pc) {
    if (shared) shared->blocks[t].block.store(pc / kc_block, std::memory_order_release);
  };
  const auto oldest_block = [&] {
    uint64_t oldest = UINT64_MAX;
    for (int t = 0; t < plan.threads; ++t)
      oldest = std::min(oldest, shared->blocks[t].block.load(std::memory_order_acquire));
    return oldest;
  };
  // Row ir of C over the micro-panels jc..jc_end of columns and K block pc. A comes from the
  // shared slot where another thread has packed it; else the first product packs it, into the
  // shared slot where this thread claims it (and marks it ready after), else into a_buf. B's
  // micro-panels are packed into b_buf where pack_b, else read from there. Where next_ir >= 0,
  // the products fetch into L2 the stored A of row next_ir of the K block at next_pc.
  const auto row = [&](int64_t ir, int64_t jc, int64_t jc_end, int64_t pc, Packed* a_buf,
                       Packed* b_buf, bool pack_b, int64_t next_ir, int64_t next_pc) {
    const int64_t kc = std::min<int64_t>(kc_block, K - pc);
    const float beta_block = pc == 0 ? beta : 1.0f;
    const int64_t i = ir * MR;
    bool pack_a = true, claimed = false;
    const uint64_t block = static_cast<uint64_t>(pc / kc_block);
    const uint64_t claim = 2 * block + 2, ready = 2 * block + 3;
    if (shared) {
      std::atomic<uint64_t>& tag = shared->rows[ir];
      uint64_t v = tag.load(std::memory_order_acquire);
      if (v == ready) {
        a_buf = shared_a_of(pc, ir);
        pack_a = false;
        fused_rows_a_shared.fetch_add(1, std::memory_order_relaxed);
      } else if (v < claim && oldest_block() + 1 >= block &&
                 tag.compare_exchange_strong(v, claim, std::memory_order_acq_rel)) {
        a_buf = shared_a_of(pc, ir);
        claimed = true;
      }
    }
    // The next row's A, fetched into L2 a share at a time by the products that read this row's
    // packed copy.
    const int64_t next_kc =
        next_ir >= 0 && next_pc < K ? std::min<int64_t>(kc_block, K - next_pc) : 0;
    const int64_t next_i = next_ir * MR;
    const int64_t calls = jc_end - jc - 1;
    for (int64_t jr = jc; jr < jc_end; ++jr) {
      const int64_t j = jr * NR;
      const int64_t c = jr - jc - 1;  // this call's share of the next row's K rows
      const int64_t r0 = c < 0 ? 0 : next_kc * c / calls;
      const int64_t r1 = c < 0 ? 0 : next_kc * (c + 1) / calls;
      const auto* next_a = r1 > r0 ? A + (next_pc + r0) * lda + next_i : nullptr;
      micro_fused<P>(jr == jc && pack_a, pack_b, kc, A + pc * lda + i, lda, a_buf, B + pc * ldb + j,
                     ldb, b_buf + (jr - jc) * ((kc + KU - 1) / KU) * NR, C + i * ldc + j, ldc,
                     beta_block, M - i, N - j, next_a, r1 - r0);
      if (jr == jc && claimed) shared->rows[ir].store(ready, std::memory_order_release);
    }
  };
#pragma omp parallel num_threads(plan.threads)
  {
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t jr_begin = n_jr * t / nt, jr_end = n_jr * (t + 1) / nt;
    Packed* const my_a = a_private + t * plan.kp_block * MR;
    Packed* const my_b = b_of(t);
    // Where A is shared, each thread starts its rows at its own share of them, which it packs
    // for the others, and goes on round to the rest, by then packed by the others.
    const int64_t first = shared ? n_ir * t / nt : 0;
    // Positions below `own` hold this thread's share of the rows, whose A it will likely pack
    // itself: only for those does fetching the stored A ahead pay.
    const int64_t own = shared ? n_ir * (t + 1) / nt - first : n_ir;
    if (jr_begin == jr_end) shares[t].ready.store(1, std::memory_order_release);  // no rows
    for (int64_t jc = jr_begin; jc < jr_end; jc += plan.fused_panels) {
      const int64_t jc_end = std::min(jr_end, jc + plan.fused_panels);
      for (int64_t pc = 0; pc < K; pc += kc_block) {
        enter_block(t, pc);
        // The row at position pos of this thread's columns, fetching ahead the A of the row
        // after it (the next in this K block, else the first of the next) where it is its own.
        const auto own_row = [&](int64_t pos, bool pack_b) {
          const int64_t next_pos = (pos + 1) % n_ir;
          row(row_at(first, pos), jc, jc_end, pc, my_a, my_b, pack_b,
              next_pos < own ? row_at(first, next_pos) : -1, next_pos > 0 ? pc : pc + kc_block);
        };
        if (jc_end < jr_end || pc + kc_block < K) {
          for (int64_t pos = 0; pos < n_ir; ++pos) own_row(pos, pos == 0);
          continue;
        }
        // The last K block of the last group: the row at position 0 packs B, then the rows are
        // shared. Every earlier K block of these columns is done, so a row taken by another
        // thread still sees its K blocks in order, and is computed from the same packed
        // operands.
        FusedShare& share = shares[t];
        share.jc = jc;
        share.jc_end = jc_end;
        share.pc = pc;
        share.first = first;
        share.rows.store(uint64_t{1} << 32 | static_cast<uint64_t>(n_ir),
                         std::memory_order_relaxed);
        own_row(0, true);
        share.ready.store(1, std::memory_order_release);
        for (int64_t pos; (pos = take_fused_row(share, true)) >= 0;) own_row(pos, false);
      }
    }
    // Then the rows other threads have left of their last K block, from the back.
    for (int64_t d = 1; d < nt; ++d) {
      const int64_t v = (t + d) % nt;
      FusedShare& share = shares[v];
      // (Yielding after a while, in case the two share a core.)
      for (int spins = 0; share.ready.load(std::memory_order_acquire) == 0; ++spins) {
        if (spins < 4096)
          _mm_pause();
        else
          std::this_thread::yield();
      }
      enter_block(t, share.pc);
      for (int64_t pos; (pos = take_fused_row(share, false)) >= 0;) {
        row(row_at(share.first, pos), share.jc, share.jc_end, share.pc, my_a, b_of(v), false, -1,
            0);
        fused_rows_shared.fetch_add(1, std::memory_order_relaxed);
      }
    }
  }
}

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
  const BlockedPlan<P> plan = blocked_plan<P>(at, bt, M, N, K, std::is_same_v<CT, float>, lda, ldb,
                                              operands_start_lines(A, lda, B, ldb));
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

  std::atomic<int64_t> next_item{0};  // work items of every (jc, ps) block, numbered on

#pragma omp parallel num_threads(plan.threads)
  {
    const int nt = omp_get_num_threads();
    int64_t items_begin = 0;
    Packed* const my_a = apack + omp_get_thread_num() * plan.a_floats_per_thread();
    for (int64_t jc = 0; jc < N; jc += P::NC) {
      const int64_t nc = std::min<int64_t>(P::NC, N - jc);
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
#pragma omp for schedule(static)
        for (int64_t item = 0; item < q_blocks * b_items; ++item) {
          const int64_t q = item / b_items, pc = ps + q * P::KC;
          const int64_t kc = std::min<int64_t>(P::KC, K - pc), kp = (kc + KU - 1) / KU;
          const int64_t k0 = bt ? 0 : item % b_items * kPackRows;
          if (k0 >= kc) continue;
          const int64_t klen = bt ? kc : std::min<int64_t>(kPackRows, kc - k0);
          Packed* const block = bpack + q * b_block_floats;
          for (int64_t jr = bt ? item % b_items : 0; jr < (bt ? item % b_items + 1 : n_jr); ++jr)
            P::pack_b(block + jr * kp * NR + k0 / KU * NR, B, ldb, bt, jc + jr * NR,
                      N - jc - jr * NR, pc + k0, klen);
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
            const Packed* const block = bpack + q * b_block_floats;
            // The A micro-panel stays in L1 while B micro-panels stream from L2 and L3.
            for (int64_t ir = ir0; ir < ir1; ++ir) {
              const int64_t i = ir * MR;
              const int m = static_cast<int>(std::min<int64_t>(MR, M - i));
              for (int64_t jr = jr0; jr < jr1; ++jr) {
                const int64_t j = jc + jr * NR;
                const int n = static_cast<int>(std::min<int64_t>(NR, N - j));
                P::micro(kp, my_a + (ir - ir0) * kp * MR, block + jr * kp * NR, C + i * ldc + j,
                         ldc, beta_block, m, n);
                ahead.step();
              }
            }
          }
          item = next;
        }
        items_begin = items_end;
#pragma omp barrier
      }
    }
  }
}

}  // namespace cputrain::kernels::detail
