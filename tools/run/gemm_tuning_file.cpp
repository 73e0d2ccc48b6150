#include "tools/run/gemm_tuning_file.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "engine/core/error.h"
#include "engine/io/atomic_file.h"
#include "kernels/cpu/cpu_features.h"

namespace cputrain {

using json = nlohmann::json;
using kernels::GemmTuning;
using kernels::GemmTuningField;
using kernels::TunedGemm;
namespace fs = std::filesystem;

namespace {
constexpr int kCacheVersion = 1;
}  // namespace

json read_gemm_tuning_cache(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return json::object();
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot be read");
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception&) {
    throw std::runtime_error("is not JSON");
  }
  if (!j.is_object() || !j.contains("version") || j["version"] != kCacheVersion ||
      !j.contains("cpus") || !j["cpus"].is_object())
    throw std::runtime_error("is not a tuning cache of version " + std::to_string(kCacheVersion));
  return j;
}

void write_gemm_tuning_cache(const std::string& path, json cache) {
  cache["version"] = kCacheVersion;
  if (!cache.contains("cpus")) cache["cpus"] = json::object();
  std::error_code ec;
  fs::create_directories(fs::path(path).parent_path(), ec);
  if (ec) throw UserError(path + ": cannot create its folder (" + ec.message() + ")");
  write_file_atomic(path, cache.dump(2) + "\n");
}

bool parse_gemm_tuning_key(const std::string& key, TunedGemm* g, int* threads) {
  const size_t slash = key.find('/');
  if (slash == std::string::npos || !kernels::tuned_gemm_from_name(key.substr(0, slash), g))
    return false;
  try {
    size_t used = 0;
    *threads = std::stoi(key.substr(slash + 1), &used);
    return used == key.size() - slash - 1;
  } catch (const std::exception&) {
    return false;
  }
}

GemmTuning gemm_tuning_of_json(const json& j, const std::string& where) {
  if (!j.is_object()) throw std::runtime_error(where + " is not an object");
  GemmTuning t;
  for (const GemmTuningField& f : kernels::gemm_tuning_fields()) {
    const std::string name(f.name);
    if (!j.contains(name)) continue;
    if (!j[name].is_number_integer())
      throw std::runtime_error(where + "." + name + " is not an integer");
    t.*f.member = j[name].get<int64_t>();
  }
  return t;
}

json gemm_tuning_to_json(const GemmTuning& t) {
  json j = json::object();
  for (const GemmTuningField& f : kernels::gemm_tuning_fields())
    j[std::string(f.name)] = t.*f.member;
  return j;
}

std::string gemm_tuning_path() {
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  if (xdg != nullptr && *xdg == '/') return std::string(xdg) + "/cputrain/gemm-tuning.json";
  const char* home = std::getenv("HOME");
  return std::string(home != nullptr && *home != '\0' ? home : ".") +
         "/.cache/cputrain/gemm-tuning.json";
}

std::string load_gemm_tuning() {
  const std::string path = gemm_tuning_path();
  const std::string cpu = kernels::cpu_model_key();
  const std::string defaults =
      "the defaults from the CPU's caches (" + kernels::cpu_caches_string() + ")";
  try {
    const json cache = read_gemm_tuning_cache(path);
    if (!cache.contains("cpus") || !cache["cpus"].contains(cpu)) return defaults;
    const json& entries = cache["cpus"][cpu];
    if (!entries.is_object()) throw std::runtime_error("the entry of this CPU is not an object");
    int set = 0;
    for (const auto& [key, entry] : entries.items()) {
      TunedGemm g{};
      int threads = 0;
      if (!parse_gemm_tuning_key(key, &g, &threads))
        throw std::runtime_error("\"" + key + "\" is not KERNEL/THREADS");
      kernels::gemm_set_tuning(g, threads, gemm_tuning_of_json(entry, key), key);
      ++set;
    }
    if (set == 0) return defaults;
    return "tuned for this CPU (" + path + ")";
  } catch (const std::exception& e) {
    kernels::gemm_clear_tunings();
    std::fprintf(stderr,
                 "cputrain: warning: %s: %s; the GEMM's default blocking is taken (cputrain tune "
                 "--reset clears it)\n",
                 path.c_str(), e.what());
    return defaults;
  }
}

}  // namespace cputrain
