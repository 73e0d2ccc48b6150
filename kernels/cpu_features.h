// What the CPU and the operating system let us run, read once with cpuid and xgetbv.
#pragma once

#include <string>

namespace cputrain::kernels {

struct CpuFeatures {
  bool avx2 = false;         // with FMA
  bool avx512 = false;       // F, BW, VL, DQ, with the OS saving zmm state
  bool avx512_bf16 = false;  // vdpbf16ps
  bool amx_bf16 = false;     // AMX-TILE and AMX-BF16, and the OS granted tile data
};

const CpuFeatures& cpu_features();
// e.g. "avx2 avx512 avx512_bf16" (what this machine has).
std::string cpu_features_string();

}  // namespace cputrain::kernels
