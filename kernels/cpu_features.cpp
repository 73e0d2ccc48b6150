#include "kernels/cpu_features.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace cputrain::kernels {
namespace {

uint64_t xgetbv0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

// Linux keeps AMX tile data disabled until a process asks for it.
bool request_amx_permission() {
  constexpr int kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

CpuFeatures detect() {
  CpuFeatures f;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = (c >> 27) & 1, fma = (c >> 12) & 1, avx = (c >> 28) & 1;
  if (!osxsave || !avx) return f;
  const uint64_t xcr0 = xgetbv0();
  const bool ymm_state = (xcr0 & 0x6) == 0x6;
  const bool zmm_state = (xcr0 & 0xe6) == 0xe6;
  const bool tile_state = (xcr0 & 0x60000) == 0x60000;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f;
  const bool avx2 = (b >> 5) & 1;
  const bool avx512f = (b >> 16) & 1, avx512dq = (b >> 17) & 1, avx512bw = (b >> 30) & 1,
             avx512vl = (b >> 31) & 1;
  const bool amx_bf16 = (d >> 22) & 1, amx_tile = (d >> 24) & 1;
  unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
  __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1);
  const bool avx512_bf16 = (a1 >> 5) & 1;
  f.avx2 = ymm_state && avx2 && fma;
  f.avx512 = f.avx2 && zmm_state && avx512f && avx512dq && avx512bw && avx512vl;
  f.avx512_bf16 = f.avx512 && avx512_bf16;
  f.amx_bf16 = f.avx512_bf16 && amx_tile && amx_bf16 && tile_state && request_amx_permission();
  return f;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

std::string cpu_features_string() {
  const CpuFeatures& f = cpu_features();
  std::string s;
  auto add = [&s](bool on, const char* name) {
    if (!on) return;
    if (!s.empty()) s += ' ';
    s += name;
  };
  add(f.avx2, "avx2");
  add(f.avx512, "avx512");
  add(f.avx512_bf16, "avx512_bf16");
  add(f.amx_bf16, "amx_bf16");
  return s.empty() ? "none" : s;
}

}  // namespace cputrain::kernels
