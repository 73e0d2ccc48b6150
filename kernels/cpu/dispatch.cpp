#include "kernels/cpu/dispatch.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>
#include <utility>

#include "kernels/attention/attention.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/peak.h"
#include "kernels/deltanet/deltanet_isa.h"
#include "kernels/gemm/gemm.h"
#include "kernels/ops/cross_entropy.h"
#include "kernels/ops/swiglu.h"

namespace cputrain::kernels {
namespace {

constexpr Isa kAllIsas[] = {Isa::Avx2, Isa::Avx512, Isa::Avx512Bf16, Isa::Amx};
constexpr std::string_view kFamilies[] = {"gemm",          "attention", "swiglu",
                                          "cross_entropy", "deltanet",  "peak"};

Isa default_ceiling() {
  static const Isa isa = default_isa_level(cpu_isa(), vdpbf16ps_slower_than_fma(cpu_features()));
  return isa;
}

std::atomic<int>& ceiling_slot() {
  static std::atomic<int> slot{[] {
    const char* env = std::getenv("CPUTRAIN_ISA");
    if (env == nullptr || *env == '\0') return static_cast<int>(default_ceiling());
    return static_cast<int>(isa_level(env, std::string("CPUTRAIN_ISA=") + env));
  }()};
  return slot;
}

// The rows forced by force_kernel (name and what the user wrote), and the rows each family took.
struct Registry {
  std::mutex mutex;
  std::map<std::string, std::pair<std::string, std::string>, std::less<>> forced;
  std::map<std::string, std::string, std::less<>> chosen;
};
Registry& registry() {
  static Registry r;
  return r;
}

std::string env_name(std::string_view family) {
  std::string name = "CPUTRAIN_";
  for (char c : family) name += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return name;
}

}  // namespace

std::string_view isa_name(Isa isa) {
  switch (isa) {
    case Isa::Avx2:
      return "avx2";
    case Isa::Avx512:
      return "avx512";
    case Isa::Avx512Bf16:
      return "avx512_bf16";
    case Isa::Amx:
      return "amx";
  }
  return "unknown";
}

bool isa_from_name(std::string_view name, Isa* isa) {
  for (Isa i : kAllIsas) {
    if (name == isa_name(i)) {
      *isa = i;
      return true;
    }
  }
  return false;
}

Isa cpu_isa() {
  const CpuFeatures& f = cpu_features();
  if (f.amx_bf16) return Isa::Amx;
  if (f.avx512_bf16) return Isa::Avx512Bf16;
  if (f.avx512) return Isa::Avx512;
  return Isa::Avx2;
}

Isa isa_level(std::string_view name, std::string_view source) {
  Isa isa;
  if (!isa_from_name(name, &isa) || isa > cpu_isa())
    throw std::invalid_argument(std::string(source) + ": not a level this CPU runs (avx2 up to " +
                                std::string(isa_name(cpu_isa())) + ")");
  return isa;
}

bool vdpbf16ps_slower_than_fma(const CpuFeatures& f) {
  return f.avx512_bf16 && f.avx512_fp16 && !f.amx_bf16;
}

Isa default_isa_level(Isa top, bool slow_vdpbf16ps) {
  return top == Isa::Avx512Bf16 && slow_vdpbf16ps ? Isa::Avx512 : top;
}

std::string isa_default_note() {
  const Isa d = default_ceiling();
  if (d == cpu_isa() || isa_ceiling() != d) return "";
  return std::string(isa_name(d)) +
         " by default: on an Intel core with AVX512_FP16 whose AMX is not offered, vdpbf16ps runs "
         "at half the FP32 FMA's rate, so bf16 products widen to FP32 as they pack (--isa " +
         std::string(isa_name(cpu_isa())) + " takes vdpbf16ps)";
}

Isa isa_ceiling() {
  return static_cast<Isa>(ceiling_slot().load(std::memory_order_relaxed));
}

void set_isa_ceiling(Isa isa) {
  if (isa > cpu_isa())
    throw std::invalid_argument("ISA level " + std::string(isa_name(isa)) +
                                " is above what this CPU runs (" +
                                std::string(isa_name(cpu_isa())) + ")");
  ceiling_slot().store(static_cast<int>(isa));
}

bool isa_usable(Isa isa) {
  return isa <= isa_ceiling();
}

bool kernel_row_usable(const KernelRow& row) {
  return isa_usable(row.needs) && (row.check == nullptr || row.check());
}

std::string usable_kernel_rows(std::span<const KernelRow> rows) {
  std::string names;
  for (const KernelRow& row : rows) {
    if (!kernel_row_usable(row)) continue;
    if (!names.empty()) names += ", ";
    names += row.name;
  }
  return names;
}

std::size_t choose_kernel_row(std::string_view family, std::span<const KernelRow> rows) {
  Registry& r = registry();
  std::string forced, source;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    if (auto it = r.forced.find(family); it != r.forced.end()) {
      forced = it->second.first;
      source = it->second.second;
    }
  }
  if (forced.empty()) {
    const std::string var = env_name(family);
    const char* env = std::getenv(var.c_str());
    if (env != nullptr && *env != '\0') {
      forced = env;
      source = var + "=" + forced;
    }
  }
  std::size_t index = rows.size();
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const bool match = forced.empty() ? rows[i].by_default : rows[i].name == forced;
    if (match && kernel_row_usable(rows[i])) {
      index = i;
      break;
    }
  }
  if (index == rows.size()) {
    if (forced.empty())
      throw std::logic_error(std::string(family) + ": no implementation runs on this CPU");
    throw std::invalid_argument(source + ": not an implementation of " + std::string(family) +
                                " this CPU runs (" + usable_kernel_rows(rows) + ")");
  }
  std::lock_guard<std::mutex> lock(r.mutex);
  r.chosen[std::string(family)] = std::string(rows[index].name);
  return index;
}

void force_kernel(std::string_view family, std::string_view name, std::string_view source) {
  std::string what(source);
  if (what.empty()) what = "--kernel " + std::string(family) + "=" + std::string(name);
  if (std::find(std::begin(kFamilies), std::end(kFamilies), family) == std::end(kFamilies))
    throw std::invalid_argument(what + ": not a kernel family (" + kernel_families() + ")");
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (auto it = r.chosen.find(family); it != r.chosen.end() && it->second != name)
    throw std::logic_error("force_kernel: " + std::string(family) + " has already chosen " +
                           it->second);
  r.forced[std::string(family)] = {std::string(name), what};
}

std::string kernel_families() {
  std::string names;
  for (std::string_view f : kFamilies) {
    if (!names.empty()) names += ", ";
    names += f;
  }
  return names;
}

std::string kernel_choices() {
  const std::string_view names[] = {gemm_backend_name(gemm_backend()),
                                    attention_kernel(),
                                    swiglu_kernel(),
                                    cross_entropy_kernel(),
                                    deltanet_kernel(),
                                    peak_kernel()};
  std::string s;
  for (std::size_t i = 0; i < std::size(kFamilies); ++i) {
    if (!s.empty()) s += ", ";
    s += std::string(kFamilies[i]) + " " + std::string(names[i]);
  }
  return s;
}

}  // namespace cputrain::kernels
