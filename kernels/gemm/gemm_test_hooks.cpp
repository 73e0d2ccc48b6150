// The GEMM's path switches and path counters (kernels/gemm/gemm_test_hooks.h).
#include "kernels/gemm/gemm_test_hooks.h"

#include <atomic>
#include <stdexcept>
#include <string>

#include "kernels/gemm/gemm_plan.h"

namespace cputrain::kernels {

namespace detail {
std::atomic<int64_t> fused_rows_shared{0};
std::atomic<int64_t> fused_rows_a_shared{0};
}  // namespace detail

namespace {
std::atomic<bool> fused_on{true};
std::atomic<bool> direct_on{true};
std::atomic<bool> skinny_on{true};
std::atomic<bool> low_rank_on{true};
std::atomic<bool> kept_b_on{true};
// Two: the rows of C a thread computes on the fused path do not stay in L2 from one K block to
// the next (its packed B and the A read past them take it), so each K block reads and writes
// them from L3 or memory; two blocks as one halve that traffic, and more make each row's B
// block outgrow L2 (the measurements are in git's history).
std::atomic<int> fused_k_blocks{2};
}  // namespace

void gemm_set_fused(bool on) {
  fused_on.store(on);
}

bool gemm_fused() {
  return fused_on.load(std::memory_order_relaxed);
}

void gemm_set_skinny(bool on) {
  skinny_on.store(on);
}

bool gemm_skinny_enabled() {
  return skinny_on.load(std::memory_order_relaxed);
}

void gemm_set_low_rank(bool on) {
  low_rank_on.store(on);
}

bool gemm_low_rank_enabled() {
  return low_rank_on.load(std::memory_order_relaxed);
}

void gemm_set_kept_b(bool on) {
  kept_b_on.store(on);
}

bool gemm_kept_b_enabled() {
  return kept_b_on.load(std::memory_order_relaxed);
}

void gemm_set_direct(bool on) {
  direct_on.store(on);
}

bool gemm_direct() {
  return direct_on.load(std::memory_order_relaxed);
}

void gemm_set_fused_k_blocks(int blocks) {
  if (blocks < 1 || blocks > 16)
    throw std::invalid_argument("gemm_set_fused_k_blocks: " + std::to_string(blocks) +
                                " is not a count of K blocks from 1 to 16");
  fused_k_blocks.store(blocks);
}

int gemm_fused_k_blocks() {
  return fused_k_blocks.load(std::memory_order_relaxed);
}

int64_t gemm_fused_rows_shared() {
  return detail::fused_rows_shared.load(std::memory_order_relaxed);
}

int64_t gemm_fused_rows_a_shared() {
  return detail::fused_rows_a_shared.load(std::memory_order_relaxed);
}

}  // namespace cputrain::kernels
