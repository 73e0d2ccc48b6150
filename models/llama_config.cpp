#include "models/llama_config.h"

#include <cmath>

namespace cputrain {
namespace {

Preset make(const char* name, int64_t vocab, int64_t d, int64_t layers, int64_t heads, int64_t ffn,
            int64_t ctx, int64_t batch, int64_t accum) {
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

std::string shortest(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

}  // namespace

std::string_view rope_pairs_name(RopePairs pairs) {
  return pairs == RopePairs::Adjacent ? "adjacent" : "half-split";
}

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
  const int64_t C = c.d_model, q = c.q_dim(), kv = c.kv_dim();
  const int64_t per_layer =
      2 * C * q + 2 * C * kv + 3 * C * c.ffn + 2 * C + (c.qkv_bias ? q + 2 * kv : 0);
  return (c.tie_embeddings ? 1 : 2) * c.vocab * C + c.n_layers * per_layer + C;
}

std::string ConfigProblem::str() const {
  std::string s = field + " " + value + " " + problem;
  if (!other.empty()) s += " " + other + " " + other_value;
  return s;
}

std::optional<ConfigProblem> validate(const LlamaConfig& c) {
  const auto text = [](int64_t v) { return std::to_string(v); };
  const std::pair<const char*, int64_t> positive[] = {
      {"vocab", c.vocab},     {"d_model", c.d_model}, {"n_layers", c.n_layers},
      {"n_heads", c.n_heads}, {"ffn", c.ffn},         {"ctx", c.ctx}};
  for (const auto& [field, v] : positive)
    if (v <= 0) return ConfigProblem{field, text(v), "must be positive", "", ""};
  if (c.n_kv_heads < 0)
    return ConfigProblem{"n_kv_heads", text(c.n_kv_heads), "must be positive", "", ""};
  if (c.n_heads % c.kv_heads() != 0)
    return ConfigProblem{"n_heads", text(c.n_heads), "is not a multiple of", "n_kv_heads",
                         text(c.kv_heads())};
  if (c.head_dim < 0)
    return ConfigProblem{"head_dim", text(c.head_dim), "must be positive", "", ""};
  if (c.head_dim == 0 && c.d_model % c.n_heads != 0)
    return ConfigProblem{"d_model", text(c.d_model), "is not a multiple of", "n_heads",
                         text(c.n_heads)};
  if (c.head_size() % 2 != 0)
    return ConfigProblem{"head_dim", text(c.head_size()), "must be even for RoPE", "", ""};
  if (!(c.rope_theta > 1.0) || !std::isfinite(c.rope_theta))
    return ConfigProblem{"rope_theta", shortest(c.rope_theta), "must be a number above 1", "", ""};
  if (!(c.norm_eps > 0.0f) || !std::isfinite(c.norm_eps))
    return ConfigProblem{"norm_eps", shortest(c.norm_eps), "must be a positive number", "", ""};
  return std::nullopt;
}

double training_flops_per_token(const LlamaConfig& c, int64_t ctx) {
  const auto d = static_cast<double>(c.d_model), layers = static_cast<double>(c.n_layers);
  const auto q = static_cast<double>(c.q_dim()), kv = static_cast<double>(c.kv_dim());
  const double matrices =
      layers * (2.0 * d * q + 2.0 * d * kv + 3.0 * d * static_cast<double>(c.ffn)) +
      static_cast<double>(c.vocab) * d;
  return 6.0 * matrices + 6.0 * layers * static_cast<double>(ctx) * q;
}

}  // namespace cputrain
