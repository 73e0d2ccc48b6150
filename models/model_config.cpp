#include "models/model_config.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "models/architecture.h"

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

std::string_view checkpointing_name(Checkpointing level) {
  switch (level) {
    case Checkpointing::None:
      return "none";
    case Checkpointing::Mlp:
      return "mlp";
    case Checkpointing::Layer:
      return "layer";
  }
  return "none";
}

std::optional<Checkpointing> parse_checkpointing(std::string_view name) {
  for (const Checkpointing c : {Checkpointing::None, Checkpointing::Mlp, Checkpointing::Layer})
    if (checkpointing_name(c) == name) return c;
  return std::nullopt;
}

std::string_view checkpointing_words(Checkpointing level) {
  return level == Checkpointing::Layer ? "per layer" : checkpointing_name(level);
}

std::vector<float> llama3_freq_factors(double theta, int64_t head_dim, double factor,
                                       double low_freq_factor, double high_freq_factor,
                                       int64_t original_ctx) {
  const double low_wavelength = static_cast<double>(original_ctx) / low_freq_factor;
  const double high_wavelength = static_cast<double>(original_ctx) / high_freq_factor;
  std::vector<float> factors;
  for (int64_t j = 0; j < head_dim / 2; ++j) {
    const double freq =
        std::pow(theta, -2.0 * static_cast<double>(j) / static_cast<double>(head_dim));
    const double wavelength = 2.0 * std::numbers::pi / freq;
    double f = factor;
    if (wavelength < high_wavelength) {
      f = 1.0;
    } else if (wavelength <= low_wavelength) {
      const double smooth = (static_cast<double>(original_ctx) / wavelength - low_freq_factor) /
                            (high_freq_factor - low_freq_factor);
      f = 1.0 / ((1.0 - smooth) / factor + smooth);
    }
    factors.push_back(static_cast<float>(f));
  }
  return factors;
}

RopeScaling yarn_rope_scaling(double theta, int64_t rope_dims, double factor, int64_t original_ctx,
                              double beta_fast, double beta_slow, bool truncate) {
  RopeScaling r;
  r.type = "yarn";
  r.factor = factor;
  r.original_ctx = original_ctx;
  r.beta_fast = beta_fast;
  r.beta_slow = beta_slow;
  r.truncate = truncate;
  // The pair whose wavelength fits `rotations` times in the original context.
  const auto dim = [&](double rotations) {
    return static_cast<double>(rope_dims) *
           std::log(static_cast<double>(original_ctx) / (rotations * 2.0 * std::numbers::pi)) /
           (2.0 * std::log(theta));
  };
  const double low = std::max(0.0, truncate ? std::floor(dim(beta_fast)) : dim(beta_fast));
  const double high = std::min(static_cast<double>(rope_dims - 1),
                               truncate ? std::ceil(dim(beta_slow)) : dim(beta_slow));
  const double scale = 1.0 / factor;
  for (int64_t j = 0; j < rope_dims / 2; ++j) {
    const double y = (static_cast<double>(j) - low) / std::max(0.001, high - low);
    const double extrapolated = 1.0 - std::clamp(y, 0.0, 1.0);
    r.freq_factors.push_back(
        static_cast<float>(1.0 / (scale * (1.0 - extrapolated) + extrapolated)));
  }
  r.attn_factor = yarn_attn_factor(factor);
  return r;
}

double yarn_attn_factor(double factor) {
  return factor > 1.0 ? 1.0 + 0.1 * std::log(factor) : 1.0;
}

std::array<int64_t, 3> text_mrope_sections(int64_t pairs) {
  const int64_t first = (pairs + 2) / 3, second = (pairs - first + 1) / 2;
  return {first, second, pairs - first - second};
}

RopeScaling linear_rope_scaling(double factor, int64_t rope_dims) {
  RopeScaling r;
  r.type = "linear";
  r.factor = factor;
  r.freq_factors.assign(static_cast<size_t>(rope_dims / 2), static_cast<float>(factor));
  return r;
}

RopeScaling rope_scaling_of_factors(std::vector<float> factors, const ModelConfig& c) {
  RopeScaling r;
  r.type = "factors";
  r.freq_factors = std::move(factors);
  if (r.freq_factors.empty()) return r;
  const double factor = *std::max_element(r.freq_factors.begin(), r.freq_factors.end());
  for (int64_t original = 1024; original <= (int64_t{1} << 20); original *= 2) {
    if (llama3_freq_factors(c.rope_theta, c.rope_dims(), factor, 1.0, 4.0, original) !=
        r.freq_factors)
      continue;
    r.type = "llama3";
    r.factor = factor;
    r.low_freq_factor = 1.0;
    r.high_freq_factor = 4.0;
    r.original_ctx = original;
    break;
  }
  return r;
}

const float* ModelConfig::rope_freq_factors() const {
  if (!rope_scaling.active()) return nullptr;
  if (rope_scaling.type == "longrope" && ctx > rope_scaling.original_ctx)
    return rope_scaling.long_factors.data();
  return rope_scaling.freq_factors.data();
}

int64_t ModelConfig::rope_dims_swa() const {
  if (rope_dim_swa > 0) return rope_dim_swa;
  return head_dim_swa > 0 ? head_dim_swa : rope_dims();
}

int64_t ModelConfig::rope_dims(int64_t layer) const {
  return windowed_layer(layer) ? rope_dims_swa() : rope_dims();
}

int64_t ModelConfig::kv_layer(int64_t layer) const {
  const int64_t first = n_layers - shared_kv_layers;
  if (shared_kv_layers <= 0 || layer < first) return layer;
  return first - (windowed_layer(layer) ? 2 : 1);
}

bool ModelConfig::rope_in_layer(int64_t layer) const {
  return std::find(no_rope_layers.begin(), no_rope_layers.end(), layer) == no_rope_layers.end();
}

bool ModelConfig::linear_layer(int64_t layer) const {
  return std::find(linear_layers.begin(), linear_layers.end(), layer) != linear_layers.end();
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

namespace {

// The MLP's matrices of C x F: gate, up and down, or up and down without a gate.
int64_t mlp_matrices(const Architecture* arch) {
  return arch && arch->mlp == Mlp::Gelu ? 2 : 3;
}

}  // namespace

int64_t parameter_count(const ModelConfig& c) {
  const Architecture* arch = find_architecture(c.architecture);
  const bool layer_norm = arch && arch->norm == Norm::LayerNorm;
  const bool parallel = arch && arch->parallel_block, dense = arch && arch->dense_biases;
  const int64_t C = c.d_model;
  // Norms: the block's one or two, each with a bias in LayerNorm.
  const int64_t norms =
      ((parallel ? 1 : 2) * (layer_norm ? 2 : 1) + (arch && arch->post_norms ? 2 : 0)) * C;
  // A mixture: the experts, the router, the shared expert; gpt-oss's router and expert biases.
  const int64_t E = c.n_experts, S = c.shared_expert_ffn;
  const bool moe_biases = arch && arch->moe_biases;
  const bool out_bias = dense || (arch && arch->attn_out_bias), sinks = arch && arch->attn_sinks;
  // Gated DeltaNet: q, k, v and z projections and their way out, the write strength's and the
  // decay's projections, the convolution's taps, dt_bias, A_log and the output norm's gains.
  const int64_t qk = c.linear_qk_dim(), v = c.linear_v_dim(), Hv = c.linear_value_heads;
  const int64_t linear = C * (2 * qk + v) + 2 * C * v + 2 * C * Hv + c.linear_conv * (2 * qk + v) +
                         2 * Hv + c.linear_value_dim;
  // Per-layer embeddings: each layer's gate, projection and norm, and the output scale.
  const int64_t P = c.per_layer_dim;
  const int64_t per_layer = (P > 0 ? 2 * C * P + C : 0) + (arch && arch->layer_output_scale);
  int64_t blocks = 0;
  for (int64_t l = 0; l < c.n_layers; ++l) {
    const int64_t q = c.q_dim(l), F = c.ffn_width(l);
    // A shared-KV layer has no k and v of its own.
    const int64_t kv = c.kv_layer(l) == l ? c.kv_dim(l) : 0;
    const int64_t v = c.own_v(l) ? c.kv_dim(l) : 0;
    // Experts beside a dense MLP: their own width, the router's scale (C), each expert's output
    // scale (E) and three norms more.
    const int64_t Fe = c.expert_width();
    const int64_t experts = E * 3 * C * Fe + E * C + (S > 0 ? 3 * C * S + C : 0) +
                            (moe_biases ? E * (1 + 2 * Fe + C) : 0) +
                            (c.experts_beside_mlp() ? C + E + 3 * C : 0);
    const int64_t dense_mlp = mlp_matrices(arch) * C * F + (dense ? F + C : 0);
    const int64_t mlp =
        (c.moe() ? experts + (c.experts_beside_mlp() ? dense_mlp : 0) : dense_mlp) + norms;
    const int64_t attention = C * (2 * q + kv + v) + (c.qkv_bias ? q + kv + v : 0) +
                              (c.qk_norm ? (kv > 0 ? 2 : 1) * c.head_size(l) : 0) +
                              (out_bias ? C : 0) + (c.attn_output_gate ? C * q : 0) +
                              (sinks ? c.n_heads : 0);
    blocks += mlp + per_layer + (c.linear_layer(l) ? linear : attention);
  }
  // The per-layer table, its projection from the embedding and that projection's norm.
  const int64_t per_layer_inputs = P > 0 ? (c.vocab + C) * c.n_layers * P + P : 0;
  return (c.tie_embeddings ? 1 : 2) * c.vocab * C + blocks + per_layer_inputs +
         (layer_norm ? 2 : 1) * C + (dense ? c.vocab : 0);
}

std::string ConfigProblem::str() const {
  std::string s = field + " " + value + " " + problem;
  if (!other.empty()) s += " " + other + " " + other_value;
  return s;
}

std::optional<ConfigProblem> validate(const ModelConfig& c) {
  const auto text = [](int64_t v) { return std::to_string(v); };
  const std::pair<const char*, int64_t> positive[] = {
      {"vocab", c.vocab},     {"d_model", c.d_model}, {"n_layers", c.n_layers},
      {"n_heads", c.n_heads}, {"ffn", c.ffn},         {"ctx", c.ctx}};
  for (const auto& [field, v] : positive)
    if (v <= 0) return ConfigProblem{field, text(v), "must be positive", "", ""};
  if (c.n_kv_heads < 0)
    return ConfigProblem{"n_kv_heads", text(c.n_kv_heads), "must be positive", "", ""};
  if (c.n_experts < 0)
    return ConfigProblem{"n_experts", text(c.n_experts), "must be positive", "", ""};
  if (c.moe() && (c.experts_used <= 0 || c.experts_used > c.n_experts))
    return ConfigProblem{"experts_used", text(c.experts_used), "must be from 1 to", "n_experts",
                         text(c.n_experts)};
  if (c.expert_ffn < 0 || (c.expert_ffn > 0 && !c.moe()))
    return ConfigProblem{"expert_ffn", text(c.expert_ffn), "must be positive with experts",
                         "n_experts", text(c.n_experts)};
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
  if (c.rope_dim < 0 || c.rope_dim > c.head_size() || c.rope_dim % 2 != 0)
    return ConfigProblem{"rope_dim", text(c.rope_dim), "must be even and at most", "head_dim",
                         text(c.head_size())};
  if (c.rope_scaling.active()) {
    const bool longrope = c.rope_scaling.type == "longrope";
    for (const auto& [name, f] :
         {std::pair{"rope_scaling.freq_factors", &c.rope_scaling.freq_factors},
          std::pair{"rope_scaling.long_factors", &c.rope_scaling.long_factors}}) {
      if (!longrope && f == &c.rope_scaling.long_factors) continue;
      if (static_cast<int64_t>(f->size()) != c.rope_dims() / 2)
        return ConfigProblem{name, text(static_cast<int64_t>(f->size())),
                             "values are not half of the rotated dimensions", "rope_dim",
                             text(c.rope_dims())};
      for (const float v : *f)
        if (!(v > 0.0f) || !std::isfinite(v))
          return ConfigProblem{name, shortest(v), "must be positive", "", ""};
    }
    if (!(c.rope_scaling.attn_factor > 0.0) || !std::isfinite(c.rope_scaling.attn_factor))
      return ConfigProblem{"rope_scaling.attn_factor", shortest(c.rope_scaling.attn_factor),
                           "must be positive", "", ""};
  }
  if (c.sliding_window < 0 || c.swa_pattern < 0 || (c.sliding_window > 0 && c.swa_pattern == 0))
    return ConfigProblem{"sliding_window", text(c.sliding_window),
                         "needs a positive swa_pattern, which is", "swa_pattern",
                         text(c.swa_pattern)};
  if (c.rope_theta_swa != 0.0 && (!(c.rope_theta_swa > 1.0) || !std::isfinite(c.rope_theta_swa)))
    return ConfigProblem{"rope_theta_swa", shortest(c.rope_theta_swa), "must be a number above 1",
                         "", ""};
  for (const auto& [field, v] :
       {std::pair{"attn_softcap", c.attn_softcap}, std::pair{"final_softcap", c.final_softcap}})
    if (!(v >= 0.0f) || !std::isfinite(v))
      return ConfigProblem{field, shortest(v), "must be positive, or 0", "", ""};
  if (!(c.attn_scale >= 0.0f) || !std::isfinite(c.attn_scale))
    return ConfigProblem{"attn_scale", shortest(c.attn_scale), "must be positive, or 0", "", ""};
  for (const int64_t layer : c.no_rope_layers)
    if (layer < 0 || layer >= c.n_layers)
      return ConfigProblem{"no_rope_layers", text(layer), "is not a layer of", "n_layers",
                           text(c.n_layers)};
  for (const int64_t layer : c.linear_layers)
    if (layer < 0 || layer >= c.n_layers)
      return ConfigProblem{"linear_layers", text(layer), "is not a layer of", "n_layers",
                           text(c.n_layers)};
  for (const auto& [field, v] :
       {std::pair{"head_dim_swa", c.head_dim_swa}, std::pair{"n_kv_heads_swa", c.n_kv_heads_swa},
        std::pair{"rope_dim_swa", c.rope_dim_swa},
        std::pair{"shared_kv_layers", c.shared_kv_layers},
        std::pair{"per_layer_dim", c.per_layer_dim}})
    if (v < 0) return ConfigProblem{field, text(v), "must be positive, or 0", "", ""};
  if (c.head_dim_swa % 2 != 0)
    return ConfigProblem{"head_dim_swa", text(c.head_dim_swa), "must be even for RoPE", "", ""};
  if (c.n_kv_heads_swa > 0 && c.n_heads % c.n_kv_heads_swa != 0)
    return ConfigProblem{"n_heads", text(c.n_heads), "is not a multiple of", "n_kv_heads_swa",
                         text(c.n_kv_heads_swa)};
  if (c.rope_dim_swa % 2 != 0 || c.rope_dim_swa > c.head_size_swa())
    return ConfigProblem{"rope_dim_swa", text(c.rope_dim_swa), "must be even and at most",
                         "head_dim_swa", text(c.head_size_swa())};
  if (!c.layer_ffn.empty() && static_cast<int64_t>(c.layer_ffn.size()) != c.n_layers)
    return ConfigProblem{"layer_ffn", text(static_cast<int64_t>(c.layer_ffn.size())) + " widths",
                         "are not one a layer of", "n_layers", text(c.n_layers)};
  for (const int64_t f : c.layer_ffn)
    if (f <= 0) return ConfigProblem{"layer_ffn", text(f), "must be positive", "", ""};
  if (c.shared_kv_layers > 0) {
    // Each shared layer reads a layer of its kind before the shared ones.
    if (c.shared_kv_layers > c.n_layers - 2)
      return ConfigProblem{"shared_kv_layers", text(c.shared_kv_layers),
                           "leaves fewer than 2 layers of their own keys and values of", "n_layers",
                           text(c.n_layers)};
    for (int64_t l = c.n_layers - c.shared_kv_layers; l < c.n_layers; ++l)
      if (c.windowed_layer(c.kv_layer(l)) != c.windowed_layer(l))
        return ConfigProblem{"shared_kv_layers", text(c.shared_kv_layers),
                             "has layer " + text(l) + " read layer " + text(c.kv_layer(l)) +
                                 " of the other kind (windowed or global), with",
                             "swa_pattern", text(c.swa_pattern)};
  }
  if (!c.linear_layers.empty()) {
    const std::pair<const char*, int64_t> linear[] = {{"linear_key_heads", c.linear_key_heads},
                                                      {"linear_value_heads", c.linear_value_heads},
                                                      {"linear_key_dim", c.linear_key_dim},
                                                      {"linear_value_dim", c.linear_value_dim},
                                                      {"linear_conv", c.linear_conv}};
    for (const auto& [field, v] : linear)
      if (v <= 0) return ConfigProblem{field, text(v), "must be positive", "", ""};
    if (c.linear_value_heads % c.linear_key_heads != 0)
      return ConfigProblem{"linear_value_heads", text(c.linear_value_heads), "is not a multiple of",
                           "linear_key_heads", text(c.linear_key_heads)};
  }
  return std::nullopt;
}

double training_flops_per_token(const ModelConfig& c, int64_t ctx) {
  const auto d = static_cast<double>(c.d_model), layers = static_cast<double>(c.n_layers);
  const auto q = static_cast<double>(c.q_dim()), kv = static_cast<double>(c.kv_dim());
  // Each layer's attention projections (none for a shared-KV layer's k and v) and MLP, and its
  // per-layer input's gate and projection.
  double blocks = 0.0, attention_width = 0.0;
  for (int64_t l = 0; l < c.n_layers; ++l) {
    const auto ql = static_cast<double>(c.q_dim(l));
    const auto kvl = c.kv_layer(l) == l ? static_cast<double>(c.kv_dim(l)) : 0.0;
    const auto vl = c.own_v(l) ? static_cast<double>(c.kv_dim(l)) : 0.0;
    const auto F = static_cast<double>(c.ffn_width(l));
    const double dense_mlp =
        static_cast<double>(mlp_matrices(find_architecture(c.architecture))) * d * F;
    blocks += 2.0 * d * ql + d * (kvl + vl) +
              (c.moe() ? static_cast<double>(c.experts_used) * 3.0 * d *
                                 static_cast<double>(c.expert_width()) +
                             static_cast<double>(c.n_experts) * d +
                             3.0 * d * static_cast<double>(c.shared_expert_ffn) +
                             (c.shared_expert_ffn > 0 ? d : 0.0) +
                             (c.experts_beside_mlp() ? dense_mlp : 0.0)
                       : dense_mlp) +
              2.0 * d * static_cast<double>(c.per_layer_dim);
    if (!c.linear_layer(l)) attention_width += ql;
  }
  const double matrices = blocks + static_cast<double>(c.vocab) * d +
                          d * static_cast<double>(c.n_layers * c.per_layer_dim);
  // Gated DeltaNet layers: their projections in place of attention's, and the delta rule's
  // products on a token of each value head, counted as the chunked form computes them forward
  // (chunks of 64: 10 x 64 x dk and 6 x dk x dv) and three times that in all.
  const auto linear = static_cast<double>(c.linear_layers.size());
  const auto lqk = static_cast<double>(c.linear_qk_dim()),
             lv = static_cast<double>(c.linear_v_dim());
  const auto dk = static_cast<double>(c.linear_key_dim),
             dv = static_cast<double>(c.linear_value_dim);
  const double linear_matrices =
      linear * (d * (2 * lqk + lv) + 2 * d * lv +
                2 * d * static_cast<double>(c.linear_value_heads) - 2 * d * q - 2 * d * kv);
  const double delta_rule =
      linear * static_cast<double>(c.linear_value_heads) * (10.0 * 64.0 * dk + 6.0 * dk * dv);
  const double gate = (layers - linear) * (c.attn_output_gate ? d * q : 0.0);
  return 6.0 * (matrices + linear_matrices + gate) + 3.0 * delta_rule +
         6.0 * static_cast<double>(ctx) * attention_width;
}

}  // namespace cputrain
