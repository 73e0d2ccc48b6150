#include "models/config_json.h"

#include <cstdio>
#include <cstdlib>

#include "engine/core/error.h"
#include "models/architecture.h"

namespace cputrain {

using nlohmann::json;

double shortest_decimal(float f) {
  char buf[32];
  for (int digits = 6; digits <= 9; ++digits) {
    std::snprintf(buf, sizeof(buf), "%.*g", digits, static_cast<double>(f));
    if (std::strtof(buf, nullptr) == f) break;
  }
  return std::strtod(buf, nullptr);
}

json model_config_json(const ModelConfig& c) {
  json j = {{"architecture", c.architecture},
            {"vocab", c.vocab},
            {"d_model", c.d_model},
            {"n_layers", c.n_layers},
            {"n_heads", c.n_heads},
            {"n_kv_heads", c.kv_heads()},
            {"head_dim", c.head_size()},
            {"ffn", c.ffn},
            {"ctx", c.ctx},
            {"norm_eps", shortest_decimal(c.norm_eps)},
            {"rope_theta", c.rope_theta},
            {"rope_pairs", rope_pairs_name(c.rope_pairs)},
            {"qkv_bias", c.qkv_bias},
            {"qk_norm", c.qk_norm},
            {"tie_embeddings", c.tie_embeddings},
            {"no_rope_layers", c.no_rope_layers},
            {"parameters", parameter_count(c)}};
  if (c.rope_dim > 0) j["rope_dim"] = c.rope_dim;
  if (c.norm_plus_one) j["norm_plus_one"] = true;
  if (c.sliding_window > 0) {
    j["sliding_window"] = c.sliding_window;
    j["swa_pattern"] = c.swa_pattern;
    j["rope_theta_swa"] = c.rope_theta_swa;
  }
  if (c.attn_scale > 0.0f) j["attn_scale"] = shortest_decimal(c.attn_scale);
  if (c.attn_softcap > 0.0f) j["attn_softcap"] = shortest_decimal(c.attn_softcap);
  if (c.final_softcap > 0.0f) j["final_softcap"] = shortest_decimal(c.final_softcap);
  if (!c.linear_layers.empty())
    j["linear_attention"] = {
        {"layers", c.linear_layers},           {"key_heads", c.linear_key_heads},
        {"value_heads", c.linear_value_heads}, {"key_dim", c.linear_key_dim},
        {"value_dim", c.linear_value_dim},     {"conv", c.linear_conv}};
  if (c.attn_output_gate) j["attn_output_gate"] = true;
  if (c.qkv_fused) j["qkv_fused"] = true;
  if (c.head_dim_swa > 0) j["head_dim_swa"] = c.head_dim_swa;
  if (c.n_kv_heads_swa > 0) j["n_kv_heads_swa"] = c.n_kv_heads_swa;
  if (c.rope_dim_swa > 0) j["rope_dim_swa"] = c.rope_dim_swa;
  if (!c.layer_ffn.empty()) j["layer_ffn"] = c.layer_ffn;
  if (c.shared_kv_layers > 0) j["shared_kv_layers"] = c.shared_kv_layers;
  if (c.per_layer_dim > 0) j["per_layer_dim"] = c.per_layer_dim;
  if (c.moe())
    j["experts"] = {{"count", c.n_experts},
                    {"used", c.experts_used},
                    {"weights_norm", c.expert_weights_norm},
                    {"shared_ffn", c.shared_expert_ffn}};
  if (c.expert_ffn > 0) j["experts"]["ffn"] = c.expert_ffn;
  if (c.experts_gate_up_fused) j["experts"]["gate_up_fused"] = true;
  if (c.k_as_v) j["k_as_v"] = true;
  if (c.rope_scaling.active()) {
    json factors = json::array(), long_factors = json::array();
    for (const float f : c.rope_scaling.freq_factors) factors.push_back(shortest_decimal(f));
    for (const float f : c.rope_scaling.long_factors) long_factors.push_back(shortest_decimal(f));
    j["rope_scaling"] = {{"type", c.rope_scaling.type},
                         {"factor", c.rope_scaling.factor},
                         {"low_freq_factor", c.rope_scaling.low_freq_factor},
                         {"high_freq_factor", c.rope_scaling.high_freq_factor},
                         {"original_ctx", c.rope_scaling.original_ctx},
                         {"freq_factors", factors}};
    if (c.rope_scaling.type == "longrope") {
      j["rope_scaling"]["long_factors"] = long_factors;
      j["rope_scaling"]["attn_factor"] = c.rope_scaling.attn_factor;
    }
    if (c.rope_scaling.type == "yarn") {
      j["rope_scaling"]["attn_factor"] = c.rope_scaling.attn_factor;
      j["rope_scaling"]["beta_fast"] = c.rope_scaling.beta_fast;
      j["rope_scaling"]["beta_slow"] = c.rope_scaling.beta_slow;
      j["rope_scaling"]["truncate"] = c.rope_scaling.truncate;
    }
  }
  return j;
}

ModelConfig model_config_from_json(const json& m, const std::string& where) {
  ModelConfig c;
  try {
    c.architecture = m.value("architecture", std::string("llama"));
    c.vocab = m.at("vocab").get<int64_t>();
    c.d_model = m.at("d_model").get<int64_t>();
    c.n_layers = m.at("n_layers").get<int64_t>();
    c.n_heads = m.at("n_heads").get<int64_t>();
    c.ffn = m.at("ffn").get<int64_t>();
    c.ctx = m.at("ctx").get<int64_t>();
    c.norm_eps = m.at("norm_eps").get<float>();
    c.rope_theta = m.at("rope_theta").get<double>();
    c.n_kv_heads = m.value("n_kv_heads", c.n_heads);
    c.head_dim = m.value("head_dim", int64_t{0});
    const std::string pairs = m.value("rope_pairs", std::string("adjacent"));
    if (pairs != "adjacent" && pairs != "half-split")
      throw UserError(where + ": model.rope_pairs must be adjacent or half-split (got " + pairs +
                      ")");
    c.rope_pairs = pairs == "adjacent" ? RopePairs::Adjacent : RopePairs::HalfSplit;
    c.qkv_bias = m.value("qkv_bias", false);
    c.qk_norm = m.value("qk_norm", false);
    c.tie_embeddings = m.value("tie_embeddings", false);
    c.no_rope_layers = m.value("no_rope_layers", std::vector<int64_t>{});
    c.rope_dim = m.value("rope_dim", int64_t{0});
    c.norm_plus_one = m.value("norm_plus_one", false);
    c.sliding_window = m.value("sliding_window", int64_t{0});
    c.swa_pattern = m.value("swa_pattern", int64_t{0});
    c.rope_theta_swa = m.value("rope_theta_swa", 0.0);
    c.attn_scale = m.value("attn_scale", 0.0f);
    c.attn_softcap = m.value("attn_softcap", 0.0f);
    c.final_softcap = m.value("final_softcap", 0.0f);
    if (m.contains("linear_attention")) {
      const json& l = m.at("linear_attention");
      c.linear_layers = l.at("layers").get<std::vector<int64_t>>();
      c.linear_key_heads = l.at("key_heads").get<int64_t>();
      c.linear_value_heads = l.at("value_heads").get<int64_t>();
      c.linear_key_dim = l.at("key_dim").get<int64_t>();
      c.linear_value_dim = l.at("value_dim").get<int64_t>();
      c.linear_conv = l.at("conv").get<int64_t>();
    }
    c.attn_output_gate = m.value("attn_output_gate", false);
    c.qkv_fused = m.value("qkv_fused", false);
    c.head_dim_swa = m.value("head_dim_swa", int64_t{0});
    c.n_kv_heads_swa = m.value("n_kv_heads_swa", int64_t{0});
    c.rope_dim_swa = m.value("rope_dim_swa", int64_t{0});
    c.layer_ffn = m.value("layer_ffn", std::vector<int64_t>{});
    c.shared_kv_layers = m.value("shared_kv_layers", int64_t{0});
    c.per_layer_dim = m.value("per_layer_dim", int64_t{0});
    c.k_as_v = m.value("k_as_v", false);
    if (m.contains("experts")) {
      const json& e = m.at("experts");
      c.n_experts = e.at("count").get<int64_t>();
      c.experts_used = e.at("used").get<int64_t>();
      c.expert_weights_norm = e.at("weights_norm").get<bool>();
      c.shared_expert_ffn = e.value("shared_ffn", int64_t{0});
      c.expert_ffn = e.value("ffn", int64_t{0});
      c.experts_gate_up_fused = e.value("gate_up_fused", false);
    }
    if (m.contains("rope_scaling")) {
      const json& r = m.at("rope_scaling");
      c.rope_scaling.type = r.at("type").get<std::string>();
      if (c.rope_scaling.type != "llama3" && c.rope_scaling.type != "longrope" &&
          c.rope_scaling.type != "linear" && c.rope_scaling.type != "yarn" &&
          c.rope_scaling.type != "factors")
        throw UserError(where + ": model.rope_scaling.type " + c.rope_scaling.type +
                        ", which cputrain does not compute (llama3, longrope, linear, yarn, "
                        "factors)");
      c.rope_scaling.factor = r.value("factor", 0.0);
      c.rope_scaling.low_freq_factor = r.value("low_freq_factor", 0.0);
      c.rope_scaling.high_freq_factor = r.value("high_freq_factor", 0.0);
      c.rope_scaling.original_ctx = r.value("original_ctx", int64_t{0});
      c.rope_scaling.freq_factors = r.at("freq_factors").get<std::vector<float>>();
      c.rope_scaling.long_factors = r.value("long_factors", std::vector<float>{});
      c.rope_scaling.attn_factor = r.value("attn_factor", 1.0);
      c.rope_scaling.beta_fast = r.value("beta_fast", 0.0);
      c.rope_scaling.beta_slow = r.value("beta_slow", 0.0);
      c.rope_scaling.truncate = r.value("truncate", true);
    }
  } catch (const json::exception& e) {
    throw UserError(where + ": model: " + e.what());
  }
  if (const std::string mismatch = architecture_mismatch(c); !mismatch.empty())
    throw UserError(where + ": model: " + mismatch);
  if (const auto problem = validate(c)) throw UserError(where + ": model: " + problem->str());
  return c;
}

std::string describe_parts(const ModelConfig& c) {
  char buf[160];
  std::snprintf(buf, sizeof(buf), "RoPE %s pairs, theta %g",
                std::string(rope_pairs_name(c.rope_pairs)).c_str(), c.rope_theta);
  std::string s = buf;
  if (c.rope_scaling.type == "llama3") {
    std::snprintf(buf, sizeof(buf),
                  ", llama3 scaling (factor %g, frequency factors %g and %g, original ctx %lld)",
                  c.rope_scaling.factor, c.rope_scaling.low_freq_factor,
                  c.rope_scaling.high_freq_factor,
                  static_cast<long long>(c.rope_scaling.original_ctx));
    s += buf;
  } else if (c.rope_scaling.type == "longrope") {
    std::snprintf(buf, sizeof(buf),
                  ", longrope scaling (%s factors, original ctx %lld, rotation scaled by %g)",
                  c.ctx > c.rope_scaling.original_ctx ? "long" : "short",
                  static_cast<long long>(c.rope_scaling.original_ctx), c.rope_scaling.attn_factor);
    s += buf;
  } else if (c.rope_scaling.type == "linear") {
    std::snprintf(buf, sizeof(buf), ", linear scaling (factor %g%s)", c.rope_scaling.factor,
                  c.sliding_window > 0 ? ", the global layers" : "");
    s += buf;
  } else if (c.rope_scaling.type == "yarn") {
    std::snprintf(buf, sizeof(buf), ", YaRN scaling (factor %g, original ctx %lld)",
                  c.rope_scaling.factor, static_cast<long long>(c.rope_scaling.original_ctx));
    s += buf;
  } else if (c.rope_scaling.active()) {
    s += ", scaled by frequency factors";
  }
  if (c.rope_dim > 0)
    s += ", on " + std::to_string(c.rope_dim) + " of each head's " + std::to_string(c.head_size()) +
         " dimensions";
  if (!c.no_rope_layers.empty()) {
    s += ", none in layers";
    for (size_t i = 0; i < c.no_rope_layers.size(); ++i)
      s += (i ? ", " : " ") + std::to_string(c.no_rope_layers[i]);
  }
  const Architecture* arch = find_architecture(c.architecture);
  std::snprintf(buf, sizeof(buf), "; %s eps %g",
                arch && arch->norm == Norm::LayerNorm ? "LayerNorm" : "RMSNorm",
                static_cast<double>(c.norm_eps));
  s += buf;
  if (c.norm_plus_one) s += " (gains held less 1)";
  if (!c.linear_layers.empty()) {
    std::snprintf(
        buf, sizeof(buf),
        "; Gated DeltaNet in %zu of %lld layers (%lld key heads, %lld value heads of "
        "%lld and %lld, a convolution of %lld)",
        c.linear_layers.size(), static_cast<long long>(c.n_layers),
        static_cast<long long>(c.linear_key_heads), static_cast<long long>(c.linear_value_heads),
        static_cast<long long>(c.linear_key_dim), static_cast<long long>(c.linear_value_dim),
        static_cast<long long>(c.linear_conv));
    s += buf;
  }
  if (c.attn_output_gate) s += "; attention's output gated";
  if (c.moe()) {
    std::snprintf(buf, sizeof(buf), "; %lld experts of ffn %lld, %lld a token%s",
                  static_cast<long long>(c.n_experts), static_cast<long long>(c.expert_width()),
                  static_cast<long long>(c.experts_used),
                  architecture_of(c).moe_gating == kernels::MoeGating::SoftmaxTopK
                      ? ", a softmax over their logits"
                  : c.expert_weights_norm ? ", their weights renormalised"
                                          : "");
    s += buf;
    if (c.shared_expert_ffn > 0)
      s += "; a gated shared expert of ffn " + std::to_string(c.shared_expert_ffn);
    if (c.experts_beside_mlp())
      s += "; beside a dense MLP, each expert's output scaled, the router on the residual";
  }
  if (c.k_as_v) {
    s += "; the global layers' v is k's projection";
  }
  if (c.sliding_window > 0) {
    std::snprintf(buf, sizeof(buf),
                  "; a sliding window of %lld on %lld of every %lld layers (RoPE theta %g)",
                  static_cast<long long>(c.sliding_window),
                  static_cast<long long>(c.swa_pattern - 1), static_cast<long long>(c.swa_pattern),
                  c.rope_theta_swa > 0.0 ? c.rope_theta_swa : c.rope_theta);
    s += buf;
  }
  if (c.attn_scale > 0.0f) {
    std::snprintf(buf, sizeof(buf), "; scores scaled by %g", static_cast<double>(c.attn_scale));
    s += buf;
  }
  if (c.attn_softcap > 0.0f || c.final_softcap > 0.0f) {
    if (c.attn_softcap > 0.0f) {
      std::snprintf(buf, sizeof(buf), "; soft-capped scores %g",
                    static_cast<double>(c.attn_softcap));
      s += buf;
    }
    if (c.final_softcap > 0.0f) {
      std::snprintf(buf, sizeof(buf), "; soft-capped logits %g",
                    static_cast<double>(c.final_softcap));
      s += buf;
    }
  }
  if (c.head_dim_swa > 0 || c.n_kv_heads_swa > 0) {
    std::snprintf(buf, sizeof(buf), "; windowed layers' heads of %lld (%lld key/value heads)",
                  static_cast<long long>(c.head_size(0)), static_cast<long long>(c.kv_heads(0)));
    s += buf;
  }
  if (!c.layer_ffn.empty()) {
    s += "; ffn by layer";
    for (const int64_t f : c.layer_ffn) {
      std::snprintf(buf, sizeof(buf), " %lld", static_cast<long long>(f));
      s += buf;
    }
  }
  if (c.shared_kv_layers > 0) {
    std::snprintf(buf, sizeof(buf), "; the last %lld layers share earlier ones' keys and values",
                  static_cast<long long>(c.shared_kv_layers));
    s += buf;
  }
  if (c.per_layer_dim > 0) {
    std::snprintf(buf, sizeof(buf), "; per-layer embeddings of %lld",
                  static_cast<long long>(c.per_layer_dim));
    s += buf;
  }
  if (c.qk_norm) s += "; q/k norms";
  if (c.qkv_bias) s += "; q/k/v biases";
  if (c.tie_embeddings) s += "; tied embeddings";
  return s;
}

}  // namespace cputrain
