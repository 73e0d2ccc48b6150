// The fused path of the blocked GEMM (gemm_blocked.h), for weight gradients: the packing runs
// inside the products, with no barrier.
//
// A weight gradient's product (A transposed and B not: both stored with K along the rows) takes
// another path where P declares kFusedPacking, says in fused_suits(M, N, K) which shapes take it,
// and provides
//   micro_fused_t<pack_a, pack_b>(kc, a_src, lda, a_pack, b_src, ldb, b_pack, C, ldc, beta, m,
//                                 n, next_a, next_rows):
//       micro's product over kc K rows (ceil(kc / KU) packed steps, up to the tuning's
//       fused_k_blocks x KC; the tile stored into C after each KC of them, as one product per K
//       block of KC would store it), reading A's rows i..i+min(m, MR) and B's columns j..j+min(n,
//       NR) straight from the matrices where pack_a / pack_b, and storing them packed as it goes,
//       else reading the packed copies (m and n: the rows and columns op(A) and op(B) have from
//       i and j on); meanwhile it fetches into L2 next_rows K rows of MR values of A, lda apart
//       from next_a (a share of the rows the next row of C packs);
// each thread takes its own range of B micro-panels (columns of C) and runs, per K block of
// fused_k_blocks (the tuning's) x KC, over every row of C: the first micro-panel of a row packs
// that row's A, the first row packs each B micro-panel. The packing runs inside the products, with
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
#pragma once

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include "kernels/gemm/gemm_plan.h"

namespace cputrain::kernels::detail {

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

}  // namespace cputrain::kernels::detail
