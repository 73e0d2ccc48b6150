#include "kernels/cpu/cpu_features.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

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
  const bool amx_bf16 = (d >> 22) & 1, amx_tile = (d >> 24) & 1, avx512_fp16 = (d >> 23) & 1;
  unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
  __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1);
  const bool avx512_bf16 = (a1 >> 5) & 1;
  f.avx2 = ymm_state && avx2 && fma;
  f.avx512 = f.avx2 && zmm_state && avx512f && avx512dq && avx512bw && avx512vl;
  f.avx512_bf16 = f.avx512 && avx512_bf16;
  f.amx_bf16 = f.avx512_bf16 && amx_tile && amx_bf16 && tile_state && request_amx_permission();
  f.avx512_fp16 = f.avx512 && avx512_fp16;
  return f;
}

CpuCaches detect_caches() {
  unsigned a, b, c, d;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return {};
  const unsigned max_leaf = a;
  const bool amd = b == 0x68747541;  // "Auth"enticAMD
  // AMD's 0x8000001D needs TOPOEXT (cpuid 0x80000001 ecx bit 22).
  const unsigned max_ext = __get_cpuid_max(0x80000000, nullptr);
  const bool topoext =
      amd && max_ext >= 0x8000001D && __get_cpuid(0x80000001, &a, &b, &c, &d) && ((c >> 22) & 1);
  const unsigned leaf = amd ? 0x8000001D : 4;
  std::vector<std::array<uint32_t, 3>> leaves;
  for (unsigned sub = 0; sub < 16 && (amd ? topoext : max_leaf >= 4); ++sub) {
    __cpuid_count(leaf, sub, a, b, c, d);
    if ((a & 0x1f) == 0) break;
    leaves.push_back({a, b, c});
  }
  if (!leaves.empty() || !amd) return parse_cache_leaves(leaves);
  // Some hypervisors leave 0x8000001D empty but keep AMD's older leaves: 0x80000005 ecx the L1
  // data cache (KiB in bits 31:24, ways in 23:16), 0x80000006 ecx L2 (KiB in 31:16) and edx L3
  // (units of 512 KiB in 31:18).
  CpuCaches caches;
  if (max_ext < 0x80000006) return caches;
  __cpuid(0x80000005, a, b, c, d);
  const int64_t l1_kib = c >> 24, l1_ways = (c >> 16) & 0xff;
  __cpuid(0x80000006, a, b, c, d);
  const int64_t l2_kib = c >> 16, l3_units = d >> 18;
  if (l1_kib == 0 || l1_ways == 0 || l1_ways == 0xff || l2_kib == 0) return caches;
  caches.l1d = l1_kib << 10;
  caches.l1d_way = caches.l1d / l1_ways;
  caches.l2 = l2_kib << 10;
  if (l3_units > 0) caches.l3 = l3_units * (512 << 10);
  caches.from_cpuid = true;
  return caches;
}

}  // namespace

CpuCaches parse_cache_leaves(const std::vector<std::array<uint32_t, 3>>& leaves) {
  CpuCaches caches;
  bool l1 = false, l2 = false;
  for (const auto& [a, b, c] : leaves) {
    const uint32_t type = a & 0x1f, level = (a >> 5) & 7;
    if (type != 1 && type != 3) continue;  // data or unified
    const int64_t ways = ((b >> 22) & 0x3ff) + 1, partitions = ((b >> 12) & 0x3ff) + 1,
                  line = (b & 0xfff) + 1, sets = static_cast<int64_t>(c) + 1;
    const int64_t bytes = ways * partitions * line * sets;
    if (level == 1) {
      caches.l1d = bytes;
      caches.l1d_way = bytes / ways;
      l1 = true;
    } else if (level == 2) {
      caches.l2 = bytes;
      l2 = true;
    } else if (level == 3) {
      caches.l3 = bytes;
      caches.l3_sharing = static_cast<int>(((a >> 14) & 0xfff) + 1);
    }
  }
  caches.from_cpuid = l1 && l2;
  return caches;
}

const CpuCaches& cpu_caches() {
  static const CpuCaches caches = detect_caches();
  return caches;
}

std::string cpu_caches_string() {
  const CpuCaches& c = cpu_caches();
  auto size = [](int64_t bytes) {
    return bytes % (1 << 20) == 0 ? std::to_string(bytes >> 20) + " MiB"
                                  : std::to_string(bytes >> 10) + " KiB";
  };
  std::string s = "L1d " + size(c.l1d) + " (" + std::to_string(c.l1d / c.l1d_way) + "-way), L2 " +
                  size(c.l2) + ", L3 " + size(c.l3);
  if (!c.from_cpuid) s += " (assumed: cpuid does not say)";
  return s;
}

std::string cpu_model_key() {
  unsigned a, b, c, d;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return "unknown";
  char vendor[13] = {};
  std::memcpy(vendor, &b, 4);
  std::memcpy(vendor + 4, &d, 4);
  std::memcpy(vendor + 8, &c, 4);
  __get_cpuid(1, &a, &b, &c, &d);
  const unsigned base_family = (a >> 8) & 0xf, base_model = (a >> 4) & 0xf, stepping = a & 0xf;
  const unsigned family = base_family == 0xf ? base_family + ((a >> 20) & 0xff) : base_family;
  const unsigned model =
      base_family == 0x6 || base_family == 0xf ? base_model + (((a >> 16) & 0xf) << 4) : base_model;
  std::string key = std::string(vendor) + " " + std::to_string(family) + "/" +
                    std::to_string(model) + "/" + std::to_string(stepping);
  if (__get_cpuid_max(0x80000000, nullptr) >= 0x80000004) {
    char brand[49] = {};
    for (unsigned i = 0; i < 3; ++i) {
      __get_cpuid(0x80000002 + i, &a, &b, &c, &d);
      std::memcpy(brand + 16 * i, &a, 4);
      std::memcpy(brand + 16 * i + 4, &b, 4);
      std::memcpy(brand + 16 * i + 8, &c, 4);
      std::memcpy(brand + 16 * i + 12, &d, 4);
    }
    std::string name(brand);
    name.erase(0, name.find_first_not_of(' '));
    name.erase(name.find_last_not_of(' ') + 1);
    if (!name.empty()) key += " " + name;
  }
  return key;
}

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
