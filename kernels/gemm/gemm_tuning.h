// The blocking of our blocked GEMM kernels (gemm_blocked.h, gemm_fused.h) that may follow the
// machine: how a product is split into work items and how much packed B a block holds, none of
// which changes a result (every tile of C is summed whole by one thread, in the order of K,
// whatever they are). The block size along K and the micro-kernels are fixed.
//
// Defaults come from the kernel's constants and the CPU's caches (cpu_caches()); `cputrain tune`
// measures better ones for the shapes of a run and caches them per CPU model, and the commands
// that train set them before their first product. Tests never set them.
#pragma once

#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>

namespace cputrain::kernels {

enum class TunedGemm { F32Avx512 = 0, Bf16Avx512 = 1, Bf16Amx = 2 };
constexpr int kTunedGemms = 3;

struct GemmTuning {
  int64_t row_panels = 0;       // MR-row micro-panels a work item holds at most (MC / MR)
  int64_t nc = 0;               // columns of a packed B block (NC), a multiple of 128
  int64_t super_block_kib = 0;  // packed B a super-block of K blocks may take
  int64_t shared_a_kib = 0;     // a thread's fused B block past which A is packed once (L2)
  int64_t fused_k_blocks = 0;   // K blocks the fused path takes as one
  int64_t fused_panels = 0;     // B micro-panels of a thread the fused path packs at a time
  bool operator==(const GemmTuning&) const = default;
};

// A field of GemmTuning: its name in the tuning cache and the `tune` report, and its range.
struct GemmTuningField {
  std::string_view name;
  int64_t GemmTuning::*member;
  int64_t min, max, multiple_of;
};
std::span<const GemmTuningField> gemm_tuning_fields();

// "f32_avx512", "bf16_avx512", "bf16_amx".
std::string_view tuned_gemm_name(TunedGemm g);
bool tuned_gemm_from_name(std::string_view name, TunedGemm* g);

// The kernel's own blocking on this CPU: its constants, L2's size from cpuid, and the fused
// path's K blocks as gemm_set_fused_k_blocks left them.
GemmTuning gemm_default_tuning(TunedGemm g);
// The blocking products of g on `threads` threads run with: what gemm_set_tuning set, its zeros
// (and all of it where nothing was set) the defaults.
GemmTuning gemm_tuning(TunedGemm g, int threads);
// From now on, products of g on `threads` threads run with t; a zero field keeps the default.
// Throws std::invalid_argument naming a field out of its range (source says where it came from).
void gemm_set_tuning(TunedGemm g, int threads, const GemmTuning& t, std::string_view source = {});
void gemm_clear_tunings();
// e.g. "row_panels 8, nc 2048, super_block_kib 4096, ...".
std::string gemm_tuning_string(const GemmTuning& t);

}  // namespace cputrain::kernels
