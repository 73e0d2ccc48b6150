#include "tools/tune_command.h"

#include <omp.h>
#include <spdlog/fmt/fmt.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <vector>

#include "engine/core/error.h"
#include "kernels/cpu/bf16.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/gemm/gemm.h"
#include "kernels/gemm/gemm_tuning.h"
#include "models/model_config.h"
#include "tools/flag_checks.h"
#include "tools/model_source.h"
#include "tools/run/gemm_tuning_file.h"

namespace cputrain {
namespace {

using json = nlohmann::json;
using kernels::GemmTuning;
using kernels::GemmTuningField;
using kernels::Transpose;
using kernels::TunedGemm;

// The tuned kernel the products of `dtype` run on with the selected GEMM backend; a UserError
// where that backend is a library's, whose blocking is its own.
TunedGemm tuned_kernel(DType dtype) {
  const kernels::GemmBackend backend = kernels::gemm_backend();
  const bool bf16 = dtype == DType::BF16 && kernels::gemm_bf16_native(backend);
  if (backend == kernels::GemmBackend::Amx) return bf16 ? TunedGemm::Bf16Amx : TunedGemm::F32Avx512;
  if (backend == kernels::GemmBackend::Avx512)
    return bf16 ? TunedGemm::Bf16Avx512 : TunedGemm::F32Avx512;
  throw UserError(
      "the GEMM here is " + std::string(kernels::gemm_backend_name(backend)) +
      " (the CPU has no AVX-512, or --gemm, --isa or CPUTRAIN_* chose it): tune measures the "
      "blocking of cputrain's own kernels (avx512, amx)");
}

// One product of a micro-batch, `count` times a step.
struct Product {
  Transpose ta, tb;
  int64_t M, N, K;
  float beta;
  int64_t count;
};

// The forward, input-gradient and weight-gradient products of each linear layer of `c` over T
// tokens, and the LM head's.
std::vector<Product> products_of(const ModelConfig& c, int64_t T) {
  std::vector<Product> out;
  auto layer = [&](int64_t in, int64_t outs, int64_t count) {
    out.push_back({Transpose::No, Transpose::Yes, T, outs, in, 0.0f, count});  // Y = X W^T
    out.push_back({Transpose::No, Transpose::No, T, in, outs, 0.0f, count});   // dX = dY W
    out.push_back({Transpose::Yes, Transpose::No, outs, in, T, 1.0f, count});  // dW += dY^T X
  };
  const int64_t L = c.n_layers;
  if (c.q_dim() == c.d_model && c.kv_dim() == c.d_model) {
    layer(c.d_model, c.d_model, 4 * L);  // q, k, v, o
  } else {
    layer(c.d_model, c.q_dim(), L);
    layer(c.d_model, c.kv_dim(), 2 * L);
    layer(c.q_dim(), c.d_model, L);
  }
  layer(c.d_model, c.ffn, 2 * L);  // gate and up
  layer(c.ffn, c.d_model, L);      // down
  layer(c.d_model, c.vocab, 1);    // the LM head
  return out;
}

struct FreeLines {
  void operator()(void* p) const { std::free(p); }
};
using Lines = std::unique_ptr<void, FreeLines>;

// `bytes` on 64-byte lines, as the trainer's tensors.
Lines lines(size_t bytes) {
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (p == nullptr) throw UserError("tune: not enough memory for the products' operands");
  return Lines(p);
}

// A product's A and B (its C is shared: the products run one at a time).
struct Operands {
  Lines a, b;
  Operands(const Product& p, bool bf16, std::mt19937& rng) {
    const size_t na = static_cast<size_t>(p.M * p.K), nb = static_cast<size_t>(p.K * p.N);
    const size_t es = bf16 ? 2 : 4;
    a = lines(na * es);
    b = lines(nb * es);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    auto fill = [&](void* dst, size_t n) {
      for (size_t i = 0; i < n; ++i) {
        const float v = u(rng);
        if (bf16)
          static_cast<uint16_t*>(dst)[i] = kernels::fp32_to_bf16(v);
        else
          static_cast<float*>(dst)[i] = v;
      }
    };
    fill(a.get(), na);
    fill(b.get(), nb);
  }
};

// Milliseconds of one call of the product.
double time_product(const Product& p, const Operands& o, float* C, bool bf16) {
  const int64_t lda = p.ta == Transpose::No ? p.K : p.M, ldb = p.tb == Transpose::No ? p.N : p.K;
  const auto start = std::chrono::steady_clock::now();
  if (bf16)
    kernels::gemm_bf16(p.ta, p.tb, p.M, p.N, p.K, static_cast<const uint16_t*>(o.a.get()), lda,
                       static_cast<const uint16_t*>(o.b.get()), ldb, p.beta, C, p.N);
  else
    kernels::gemm_f32(p.ta, p.tb, p.M, p.N, p.K, static_cast<const float*>(o.a.get()), lda,
                      static_cast<const float*>(o.b.get()), ldb, p.beta, C, p.N);
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

// Which of a step's products a field of the tuning decides: the fused path's fields only the
// weight gradients'; the others the blocked path's products, the forward and input gradients.
enum class Products { All, WeightGradients, Others };

Products products_of_field(std::string_view field) {
  return field.starts_with("fused") || field == "shared_a_kib" ? Products::WeightGradients
                                                               : Products::Others;
}

struct Search {
  std::vector<Product> products;
  std::vector<Operands> operands;
  Lines c;  // the largest product's C, zeroed
  bool bf16;
  TunedGemm kernel;
  int threads;
  int64_t rounds;

  // A step's products of `which` kind under t, in milliseconds (each product once, weighted by
  // its count).
  double step_ms(const GemmTuning& t, Products which = Products::All) const {
    kernels::gemm_set_tuning(kernel, threads, t);
    double ms = 0.0;
    for (size_t i = 0; i < products.size(); ++i) {
      const bool weight_gradient = products[i].ta == Transpose::Yes;
      if (which != Products::All && weight_gradient != (which == Products::WeightGradients))
        continue;
      ms += static_cast<double>(products[i].count) *
            time_product(products[i], operands[i], static_cast<float*>(c.get()), bf16);
    }
    return ms;
  }
  // The fastest of `rounds` timings of each of `candidates`, taken in turn round by round, so
  // that a spell of slowness of the machine falls on all of them alike (and the fastest, the
  // one least held up by anything else running).
  std::vector<double> compare(const std::vector<GemmTuning>& candidates,
                              Products which = Products::All) const {
    std::vector<double> out(candidates.size(), std::numeric_limits<double>::infinity());
    for (int64_t r = 0; r < rounds; ++r)
      for (size_t c = 0; c < candidates.size(); ++c)
        out[c] = std::min(out[c], step_ms(candidates[c], which));
    return out;
  }
};

// The values tried for each field, around the default `d`.
std::vector<int64_t> candidates_of(std::string_view field, const GemmTuning& d) {
  if (field == "row_panels") return {2, 4, 8, 16};
  if (field == "nc") return {1024, 2048, 4096};
  if (field == "super_block_kib") return {1024, 2048, 4096, 8192, 16384};
  if (field == "shared_a_kib") return {d.shared_a_kib / 2, d.shared_a_kib, d.shared_a_kib * 2};
  if (field == "fused_k_blocks") return {1, 2, 3, 4};
  if (field == "fused_panels") return {12, 24, 48};
  return {};
}

ModelConfig shapes_config(const TuneArgs& a, int64_t* tokens, std::string* what) {
  if (!a.model.empty()) {
    const ModelConfig c = load_model_config(a.model, "--model", kDefaultImportCtx);
    *tokens = a.tokens > 0 ? a.tokens : 2048;
    *what = a.model;
    return c;
  }
  const Preset p = preset_flag(a.preset);
  *tokens = a.tokens > 0 ? a.tokens : p.batch * p.config.ctx;
  *what = "preset " + a.preset;
  return p.config;
}

int show_or_reset(const TuneArgs& a, const std::string& path) {
  const std::string cpu = kernels::cpu_model_key();
  json cache;
  try {
    cache = read_gemm_tuning_cache(path);
  } catch (const std::runtime_error& e) {
    if (!a.reset) throw UserError(path + ": " + e.what() + " (cputrain tune --reset rewrites it)");
    cache = json::object();
  }
  if (a.reset) {
    if (cache.contains("cpus")) cache["cpus"].erase(cpu);
    write_gemm_tuning_cache(path, cache);
    std::printf("%s: no tuning for %s now; runs take the defaults\n", path.c_str(), cpu.c_str());
    return 0;
  }
  std::printf("cpu: %s\ncaches: %s\ncache file: %s\n", cpu.c_str(),
              kernels::cpu_caches_string().c_str(), path.c_str());
  for (int g = 0; g < kernels::kTunedGemms; ++g) {
    const auto kernel = static_cast<TunedGemm>(g);
    std::printf("defaults %-12s %s\n", std::string(kernels::tuned_gemm_name(kernel)).c_str(),
                kernels::gemm_tuning_string(kernels::gemm_default_tuning(kernel)).c_str());
  }
  if (!cache.contains("cpus") || !cache["cpus"].contains(cpu)) {
    std::printf("no tuning for this CPU (cputrain tune measures one)\n");
    return 0;
  }
  for (const auto& [key, entry] : cache["cpus"][cpu].items()) {
    const GemmTuning t = gemm_tuning_of_json(entry, key);
    std::printf("tuned %-15s %s", key.c_str(), kernels::gemm_tuning_string(t).c_str());
    if (entry.contains("measured") && entry["measured"].is_string())
      std::printf(" (%s)", entry["measured"].get<std::string>().c_str());
    std::printf("\n");
  }
  return 0;
}

}  // namespace

void add_tune_flags(CLI::App& app, TuneArgs& a) {
  app.add_option("--preset", a.preset, "The preset whose products are measured (default mega)");
  app.add_option("--model", a.model,
                 "A model (GGUF file, Hugging Face folder or run) whose products are measured");
  app.add_option("--tokens", a.tokens,
                 "Tokens of a micro-batch (default: the preset's batch x ctx; 2048 for a model)");
  app.add_option("--threads", a.threads, "Threads (default: all the CPUs)")->check(threads_limit());
  app.add_option("--dtype", a.dtype, "auto, bf16 or fp32: the products' precision (default auto)");
  app.add_option("--rounds", a.rounds, "Timings of each candidate, in turn (default 5)");
  app.add_option("--min-gain", a.min_gain,
                 "A value replaces the one before where it is this fraction faster (default 0.02)");
  app.add_flag("--show", a.show, "Print this CPU's caches, defaults and tunings; measure nothing");
  app.add_flag("--reset", a.reset, "Remove this CPU's tunings from the cache");
  add_kernel_flags(app, a.kernels);
}

int run_tune(const TuneArgs& a) {
  select_kernels(a.kernels, false);  // measured from the defaults
  const std::string path = gemm_tuning_path();
  if (a.show || a.reset) return show_or_reset(a, path);
  if (a.rounds < 1 || a.rounds > 100) throw UserError("--rounds must be in 1..100");
  if (!(a.min_gain >= 0.0 && a.min_gain < 1.0)) throw UserError("--min-gain must be in [0, 1)");
  if (a.tokens < 0) throw UserError("--tokens must be positive");
  if (a.threads < 0) throw UserError("--threads must be positive");
  // A cache that cannot be read is refused before anything is measured.
  json cache;
  try {
    cache = read_gemm_tuning_cache(path);
  } catch (const std::runtime_error& e) {
    throw UserError(path + ": " + e.what() + " (cputrain tune --reset rewrites it)");
  }
  std::string dtype_why;
  const DType dtype = choose_dtype(a.dtype, &dtype_why);
  const int threads = a.threads > 0 ? a.threads : omp_get_num_procs();
  omp_set_num_threads(threads);
  int64_t tokens = 0;
  std::string what;
  const ModelConfig config = shapes_config(a, &tokens, &what);

  Search s;
  s.kernel = tuned_kernel(dtype);
  s.bf16 = s.kernel != TunedGemm::F32Avx512;
  s.threads = threads;
  s.rounds = a.rounds;
  s.products = products_of(config, tokens);
  std::mt19937 rng(1);
  int64_t c_floats = 0;
  for (const Product& p : s.products) {
    s.operands.emplace_back(p, s.bf16, rng);
    c_floats = std::max(c_floats, p.M * p.N);
  }
  s.c = lines(static_cast<size_t>(c_floats) * 4);
  std::fill_n(static_cast<float*>(s.c.get()), c_floats, 0.0f);
  const std::string kernel_name(kernels::tuned_gemm_name(s.kernel));
  std::printf("cpu: %s; %s\n", kernels::cpu_model_key().c_str(),
              kernels::cpu_caches_string().c_str());
  std::printf("measuring %s products of %s at %ld tokens on %d threads (kernel %s, %s)\n",
              s.bf16 ? "bf16" : "fp32", what.c_str(), static_cast<long>(tokens), threads,
              kernel_name.c_str(), dtype_why.c_str());
  const auto started = std::chrono::steady_clock::now();

  const GemmTuning defaults = kernels::gemm_default_tuning(s.kernel);
  s.step_ms(defaults);  // the first calls grow the packing buffers and fault in the operands
  GemmTuning best = defaults;
  for (const GemmTuningField& f : kernels::gemm_tuning_fields()) {
    std::vector<GemmTuning> tried = {best};
    for (int64_t v : candidates_of(f.name, defaults)) {
      if (v < f.min || v > f.max || v % f.multiple_of != 0 || v == best.*f.member) continue;
      GemmTuning t = best;
      t.*f.member = v;
      tried.push_back(t);
    }
    if (tried.size() < 2) continue;
    const std::vector<double> ms = s.compare(tried, products_of_field(f.name));
    // The fastest, where it beats the value before by min_gain.
    size_t pick = static_cast<size_t>(std::min_element(ms.begin(), ms.end()) - ms.begin());
    if (!(ms[pick] < ms[0] * (1.0 - a.min_gain))) pick = 0;
    std::string line = fmt::format("{:<16}", f.name);
    for (size_t i = 0; i < tried.size(); ++i)
      line += fmt::format(" {}{} {:.1f} ms", i == pick ? "*" : "", tried[i].*f.member, ms[i]);
    std::printf("%s\n", line.c_str());
    best = tried[pick];
  }
  // The tuning against the defaults over all the products, in turn once more: kept where it
  // holds its gain, else the defaults are.
  double gain = 0.0;
  std::string measured;
  if (best == defaults) {
    measured = fmt::format("{} at {} tokens: the defaults the fastest", what, tokens);
  } else {
    const std::vector<double> final_ms = s.compare({defaults, best});
    gain = final_ms[0] / final_ms[1] - 1.0;
    std::printf("step's products: defaults %.1f ms, tuned %.1f ms (%+.1f%%)\n", final_ms[0],
                final_ms[1], 100.0 * gain);
    measured = fmt::format("{} at {} tokens: {:.1f} ms, {:.1f} ms by default", what, tokens,
                           final_ms[1], final_ms[0]);
  }
  const bool tuned = best != defaults && gain >= a.min_gain;
  const GemmTuning kept = tuned ? best : defaults;
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  std::printf("%s %s/%d: %s (%.0f s of measuring)\n", tuned ? "tuned" : "defaults kept",
              kernel_name.c_str(), threads, kernels::gemm_tuning_string(kept).c_str(), seconds);
  json entry = gemm_tuning_to_json(kept);
  entry["measured"] = measured;
  cache["cpus"][kernels::cpu_model_key()][kernel_name + "/" + std::to_string(threads)] = entry;
  write_gemm_tuning_cache(path, cache);
  std::printf("written to %s; the commands that compute read it\n", path.c_str());
  return 0;
}

}  // namespace cputrain
