// The GEMM tuning's cache (`cputrain tune`): one JSON file in the user's cache folder,
//   {"version": 1, "cpus": {CPU MODEL: {"KERNEL/THREADS": {FIELD: VALUE, ..., "measured": TEXT}}}}
// with CPU MODEL kernels::cpu_model_key(), KERNEL a tuned kernel's name (bf16_avx512, ...) and
// the fields of kernels::GemmTuning.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "kernels/gemm/gemm_tuning.h"

namespace cputrain {

// $XDG_CACHE_HOME/cputrain/gemm-tuning.json, else $HOME/.cache/cputrain/gemm-tuning.json.
std::string gemm_tuning_path();
// The cache at `path` ({} where there is no file); std::runtime_error saying what is wrong
// where it cannot be read or is not the format.
nlohmann::json read_gemm_tuning_cache(const std::string& path);
// Writes `cache` to `path` whole or not at all, creating its folder; a UserError where it cannot.
void write_gemm_tuning_cache(const std::string& path, nlohmann::json cache);
// An entry "KERNEL/THREADS": its kernel and thread count; false where malformed.
bool parse_gemm_tuning_key(const std::string& key, kernels::TunedGemm* g, int* threads);
// An entry's fields (std::runtime_error naming `where` and the field where one is not an
// integer), and the fields of t as an entry.
kernels::GemmTuning gemm_tuning_of_json(const nlohmann::json& j, const std::string& where);
nlohmann::json gemm_tuning_to_json(const kernels::GemmTuning& t);

// Sets the tunings the cache holds for this CPU model (kernels::gemm_set_tuning). Returns what a
// run's log says of its blocking: tuned (and the file) or the defaults from the caches. A cache
// that cannot be read or holds a bad value is ignored, with one warning line on stderr.
std::string load_gemm_tuning();

}  // namespace cputrain
