// What the CPU and the operating system let us run, read once with cpuid and xgetbv.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace cputrain::kernels {

struct CpuFeatures {
  bool avx2 = false;         // with FMA
  bool avx512 = false;       // F, BW, VL, DQ, with the OS saving zmm state
  bool avx512_bf16 = false;  // vdpbf16ps
  bool amx_bf16 = false;     // AMX-TILE and AMX-BF16, and the OS granted tile data
  bool avx512_fp16 = false;  // AVX512_FP16: an Intel core of Sapphire Rapids or after
};

// The data caches of one core, from cpuid (leaf 4 on Intel, 0x8000001D on AMD), in bytes; a
// level the CPU does not report keeps the figure of the x86 cores the kernels were first tuned on
// (Zen 4: 32 KiB 8-way L1, 1 MiB L2, 32 MiB L3), with `from_cpuid` false.
struct CpuCaches {
  int64_t l1d = 32 << 10;
  int64_t l1d_way = 4 << 10;  // L1's size over its ways: rows this far apart share a set
  int64_t l2 = 1 << 20;
  int64_t l3 = 32 << 20;  // the whole L3 a core reaches
  int l3_sharing = 8;     // the logical processors that share it
  bool from_cpuid = false;
};

const CpuFeatures& cpu_features();
const CpuCaches& cpu_caches();
// Parses the cache descriptors of cpuid leaf 4 or 0x8000001D, one {eax, ebx, ecx} per subleaf
// until a null type (for tests: cpu_caches() reads the CPU's own).
CpuCaches parse_cache_leaves(const std::vector<std::array<uint32_t, 3>>& leaves);
// e.g. "L1d 48 KiB (12-way), L2 1 MiB, L3 32 MiB".
std::string cpu_caches_string();
// The CPU's model as cpuid names it: vendor, family, model, stepping and brand string, e.g.
// "AuthenticAMD 26/2/1 AMD EPYC"; what the GEMM's tuning is cached under.
std::string cpu_model_key();
// e.g. "avx2 avx512 avx512_bf16" (what this machine has).
std::string cpu_features_string();

}  // namespace cputrain::kernels
