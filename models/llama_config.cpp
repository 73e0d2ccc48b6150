#include "models/llama_config.h"

namespace cputrain {
namespace {

Preset make(const char* name, int64_t vocab, int64_t d, int64_t layers, int64_t heads,
            int64_t ffn, int64_t ctx, int64_t batch, int64_t accum) {
  Preset p;
  p.name = name;
  p.config.vocab = vocab;
  p.config.d_model = d;
  p.config.n_layers = layers;
  p.config.n_heads = heads;
  p.config.ffn = ffn;
  p.config.ctx = ctx;
  p.batch = batch;
  p.accum = accum;
  return p;
}

const std::vector<Preset>& presets() {
  static const std::vector<Preset> table = {
      make("tiny", 512, 64, 2, 4, 192, 64, 4, 1),
      make("mini", 16384, 256, 6, 8, 768, 256, 8, 1),
      make("mega", 16384, 512, 24, 8, 1536, 1024, 4, 4),
      make("behemoth", 16384, 1024, 32, 16, 2816, 1024, 2, 8),
      make("titan", 16384, 1536, 48, 24, 4096, 1024, 1, 16),
  };
  return table;
}

}  // namespace

std::optional<Preset> find_preset(const std::string& name) {
  for (const Preset& p : presets())
    if (p.name == name) return p;
  return std::nullopt;
}

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const Preset& p : presets()) names.push_back(p.name);
  return names;
}

int64_t parameter_count(const LlamaConfig& c) {
  const int64_t per_layer = 4 * c.d_model * c.d_model + 3 * c.d_model * c.ffn + 2 * c.d_model;
  return 2 * c.vocab * c.d_model + c.n_layers * per_layer + c.d_model;
}

std::string validate(const LlamaConfig& c) {
  auto positive = [](int64_t v, const char* flag) -> std::string {
    return v > 0 ? "" : std::string(flag) + " must be positive (got " + std::to_string(v) + ")";
  };
  for (const std::string& e :
       {positive(c.vocab, "--vocab"), positive(c.d_model, "--d-model"),
        positive(c.n_layers, "--layers"), positive(c.n_heads, "--heads"),
        positive(c.ffn, "--ffn"), positive(c.ctx, "--ctx")}) {
    if (!e.empty()) return e;
  }
  if (c.d_model % c.n_heads != 0)
    return "--d-model " + std::to_string(c.d_model) + " is not a multiple of --heads " +
           std::to_string(c.n_heads);
  if (c.head_dim() % 2 != 0)
    return "head dimension --d-model / --heads = " + std::to_string(c.head_dim()) +
           " must be even for RoPE";
  return "";
}

double training_flops_per_token(const LlamaConfig& c, int64_t ctx) {
  const double d = static_cast<double>(c.d_model), layers = static_cast<double>(c.n_layers);
  const double matrices = layers * (4.0 * d * d + 3.0 * d * static_cast<double>(c.ffn)) +
                          static_cast<double>(c.vocab) * d;
  return 6.0 * matrices + 6.0 * layers * static_cast<double>(ctx) * d;
}

}  // namespace cputrain
