#include "kernels/gemm/gemm_tuning.h"

#include <array>
#include <atomic>
#include <mutex>

#include "kernels/cpu/cpu_features.h"
#include "kernels/gemm/gemm_test_hooks.h"

namespace cputrain::kernels {
namespace {

constexpr int kMaxTunedThreads = 512;

// Each kernel's default rows of a work item (MC / MR) and columns of a packed B block (NC); the
// kernels' policies (kernels/gemm_*.cpp) hold only their register tiles and KC.
struct KernelBlocks {
  std::string_view name;
  int64_t row_panels, nc;
};
constexpr std::array<KernelBlocks, kTunedGemms> kKernels = {{
    {"f32_avx512", 8, 2048},
    {"bf16_avx512", 8, 2048},
    {"bf16_amx", 4, 1024},
}};

// Packed B a super-block may take: it is read from L3 by every thread.
constexpr int64_t kSuperBlockKib = 4096;
// B micro-panels of a thread's columns packed at a time on the fused path. A is read again for
// each group, so groups are wide: 24 x 32 columns, 3 MiB of packed FP32 B at K blocks of 1024,
// which is read from L2 and L3 well enough.
constexpr int64_t kFusedPanels = 24;

constexpr GemmTuningField kFields[] = {
    {"row_panels", &GemmTuning::row_panels, 1, 64, 1},
    {"nc", &GemmTuning::nc, 128, 1 << 16, 128},
    {"super_block_kib", &GemmTuning::super_block_kib, 64, 1 << 20, 1},
    {"shared_a_kib", &GemmTuning::shared_a_kib, 64, 1 << 20, 1},
    {"fused_k_blocks", &GemmTuning::fused_k_blocks, 1, 16, 1},
    {"fused_panels", &GemmTuning::fused_panels, 1, 256, 1},
};

// Read by every product: `any` tells without the lock that nothing is set (the tests' case and
// an untuned machine's).
struct Table {
  std::mutex mutex;
  std::array<std::array<GemmTuning, kMaxTunedThreads + 1>, kTunedGemms> set{};
  std::atomic<bool> any{false};
};

Table& table() {
  static Table t;
  return t;
}

}  // namespace

std::span<const GemmTuningField> gemm_tuning_fields() {
  return kFields;
}

std::string_view tuned_gemm_name(TunedGemm g) {
  return kKernels[static_cast<int>(g)].name;
}

bool tuned_gemm_from_name(std::string_view name, TunedGemm* g) {
  for (int i = 0; i < kTunedGemms; ++i) {
    if (kKernels[i].name != name) continue;
    *g = static_cast<TunedGemm>(i);
    return true;
  }
  return false;
}

GemmTuning gemm_default_tuning(TunedGemm g) {
  const KernelBlocks& k = kKernels[static_cast<int>(g)];
  GemmTuning t;
  t.row_panels = k.row_panels;
  t.nc = k.nc;
  t.super_block_kib = kSuperBlockKib;
  t.shared_a_kib = cpu_caches().l2 >> 10;
  t.fused_k_blocks = gemm_fused_k_blocks();
  t.fused_panels = kFusedPanels;
  return t;
}

GemmTuning gemm_tuning(TunedGemm g, int threads) {
  GemmTuning t = gemm_default_tuning(g);
  if (threads < 1 || threads > kMaxTunedThreads) return t;
  GemmTuning set;
  {
    Table& tb = table();
    if (!tb.any.load(std::memory_order_acquire)) return t;
    std::lock_guard<std::mutex> lock(tb.mutex);
    set = tb.set[static_cast<int>(g)][threads];
  }
  for (const GemmTuningField& f : kFields)
    if (set.*f.member != 0) t.*f.member = set.*f.member;
  return t;
}

void gemm_set_tuning(TunedGemm g, int threads, const GemmTuning& t, std::string_view source) {
  const std::string where = source.empty() ? "gemm_set_tuning" : std::string(source);
  if (threads < 1 || threads > kMaxTunedThreads)
    throw std::invalid_argument(where + ": threads " + std::to_string(threads) + " is not in 1.." +
                                std::to_string(kMaxTunedThreads));
  for (const GemmTuningField& f : kFields) {
    const int64_t v = t.*f.member;
    if (v == 0) continue;
    if (v < f.min || v > f.max || v % f.multiple_of != 0)
      throw std::invalid_argument(
          where + ": " + std::string(f.name) + " " + std::to_string(v) + " is not in " +
          std::to_string(f.min) + ".." + std::to_string(f.max) +
          (f.multiple_of > 1 ? " or not a multiple of " + std::to_string(f.multiple_of)
                             : std::string()));
  }
  Table& tb = table();
  std::lock_guard<std::mutex> lock(tb.mutex);
  tb.set[static_cast<int>(g)][threads] = t;
  tb.any.store(true, std::memory_order_release);
}

void gemm_clear_tunings() {
  Table& tb = table();
  std::lock_guard<std::mutex> lock(tb.mutex);
  for (auto& per_kernel : tb.set) per_kernel.fill(GemmTuning{});
  tb.any.store(false, std::memory_order_release);
}

std::string gemm_tuning_string(const GemmTuning& t) {
  std::string s;
  for (const GemmTuningField& f : kFields) {
    if (!s.empty()) s += ", ";
    s += std::string(f.name) + " " + std::to_string(t.*f.member);
  }
  return s;
}

}  // namespace cputrain::kernels
