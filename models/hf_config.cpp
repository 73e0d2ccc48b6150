#include "models/hf_config.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <unordered_map>

#include "engine/core/error.h"
#include "engine/train/parameters.h"
#include "models/architecture.h"
#include "models/decoder.h"
#include "models/file_hyperparameters.h"
#include "models/hf_json.h"
#include "models/lora.h"
#include "models/tensor_names.h"

namespace cputrain {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// The typed values of config.json: a UserError naming the file and key for a value of another
// type; absent (or null) where the key is not there.
class ConfigValues {
 public:
  ConfigValues(const json& j, std::string where) : j_(j), where_(std::move(where)) {}

  bool has_null(const std::string& key) const {
    const auto it = j_.find(key);
    return it != j_.end() && it->is_null();
  }
  const json* find(const std::string& key) const {
    const auto it = j_.find(key);
    return it == j_.end() || it->is_null() ? nullptr : &*it;
  }
  std::optional<int64_t> whole(const std::string& key) const {
    const json* v = find(key);
    if (!v) return std::nullopt;
    if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
      throw UserError(where_ + ": " + key + " " + v->dump() + " is more than cputrain reads");
    if (!v->is_number_integer()) wrong(key, *v, "a whole number");
    return v->get<int64_t>();
  }
  double number(const std::string& key, double fallback) const {
    const json* v = find(key);
    if (!v) return fallback;
    if (!v->is_number()) wrong(key, *v, "a number");
    return v->get<double>();
  }
  bool flag(const std::string& key, bool fallback) const {
    const json* v = find(key);
    if (!v) return fallback;
    if (!v->is_boolean()) wrong(key, *v, "true or false");
    return v->get<bool>();
  }
  std::string text(const std::string& key, const std::string& fallback) const {
    const json* v = find(key);
    if (!v) return fallback;
    if (!v->is_string()) wrong(key, *v, "a string");
    return v->get<std::string>();
  }

 private:
  [[noreturn]] void wrong(const std::string& key, const json& v, const std::string& want) const {
    throw UserError(where_ + ": " + key + " " + json_shown(v) + " is " + json_kind(v) + ", not " +
                    want);
  }
  const json& j_;
  std::string where_;
};

}  // namespace

bool is_hf_folder(const std::string& folder) {
  const fs::path config = fs::path(folder) / "config.json";
  if (!fs::exists(config)) return false;
  std::ifstream in(config);
  const json j = json::parse(in, nullptr, false);
  return j.is_object() && j.contains("model_type");
}

namespace {

// A list of `n` positive numbers in config.json's rope_scaling.
std::vector<float> hf_factors(const json* list, int64_t n, const std::string& what) {
  std::vector<float> out;
  if (list && list->is_array() && static_cast<int64_t>(list->size()) == n)
    for (const json& v : *list)
      if (v.is_number() && v.get<double>() > 0.0) out.push_back(v.get<float>());
  if (static_cast<int64_t>(out.size()) != n)
    throw UserError(what + " is not a list of " + std::to_string(n) +
                    " positive numbers (half the rotated dimensions)");
  return out;
}

// config.json's rope_scaling of a model of `c` (theta, rotated dimensions and declared context
// known): Llama 3's, with its four numbers, Phi-3's longrope ("su" in older files), with its
// short and long factors and the scale of the rotation (attention_factor, or Hugging Face's
// sqrt(1 + ln(ctx / original) / ln(original))), or linear, with its factor (Gemma 3's). A UserError
// naming the file for another type, one the architecture does not apply, a key it does not read, or
// a missing or unusable number.
RopeScaling hf_rope_scaling(const json& scaling, const ConfigValues& top, const Architecture& arch,
                            const ModelConfig& c, const std::string& where) {
  if (!scaling.is_object())
    throw UserError(where + ": rope_scaling " + json_shown(scaling) + " is not an object");
  const ConfigValues values(scaling, where + ": rope_scaling");
  std::string type = values.text("rope_type", values.text("type", ""));
  if (type == "su") type = "longrope";
  if (std::find(arch.rope_scalings.begin(), arch.rope_scalings.end(), type) ==
      arch.rope_scalings.end())
    throw UserError(where + ": rope_scaling type " + type +
                    ", which cputrain does not compute for " + std::string(arch.name) +
                    " (it computes " + rope_scaling_names(arch) + ")");
  const std::vector<std::string_view> keys =
      type == "llama3"
          ? std::vector<std::string_view>{"rope_type",        "type",
                                          "factor",           "low_freq_factor",
                                          "high_freq_factor", "original_max_position_embeddings"}
      : type == "linear" ? std::vector<std::string_view>{"rope_type", "type", "factor"}
      : type == "yarn"
          ? std::vector<std::string_view>{"rope_type",        "type",
                                          "factor",           "beta_fast",
                                          "beta_slow",        "truncate",
                                          "attention_factor", "original_max_position_embeddings"}
          : std::vector<std::string_view>{"rope_type",        "type",
                                          "long_factor",      "short_factor",
                                          "attention_factor", "original_max_position_embeddings"};
  for (const auto& [key, value] : scaling.items())
    if (std::find(keys.begin(), keys.end(), key) == keys.end())
      throw UserError(where + ": rope_scaling." + key + " " + json_shown(value) +
                      ", which cputrain does not read for " + type + " scaling");
  if (type == "linear") {
    const double factor = values.number("factor", 0.0);
    if (!(factor > 0.0) || !std::isfinite(factor))
      throw UserError(where + ": rope_scaling of type linear needs a positive factor");
    return linear_rope_scaling(factor, c.rope_dims());
  }
  if (type == "yarn") {
    // Transformers' defaults: beta 32 and 1, the dimensions rounded, cos and sin scaled by
    // 1 + 0.1 ln factor.
    const double factor = values.number("factor", 0.0);
    const int64_t original = values.whole("original_max_position_embeddings").value_or(c.ctx);
    const double fast = values.number("beta_fast", 32.0), slow = values.number("beta_slow", 1.0);
    if (!(factor >= 1.0) || !std::isfinite(factor) || original <= 0 || !(fast > slow) ||
        !(slow > 0.0) || !std::isfinite(fast))
      throw UserError(where +
                      ": rope_scaling of type yarn needs factor >= 1, beta_fast > beta_slow > 0 "
                      "and a positive original_max_position_embeddings");
    RopeScaling r = yarn_rope_scaling(c.rope_theta, c.rope_dims(), factor, original, fast, slow,
                                      values.flag("truncate", true));
    r.attn_factor = values.number("attention_factor", r.attn_factor);
    return r;
  }
  RopeScaling r;
  r.type = type;
  r.original_ctx = values.whole("original_max_position_embeddings")
                       .value_or(top.whole("original_max_position_embeddings").value_or(0));
  if (type == "longrope") {
    const int64_t n = c.rope_dims() / 2;
    r.freq_factors =
        hf_factors(values.find("short_factor"), n, where + ": rope_scaling.short_factor");
    r.long_factors =
        hf_factors(values.find("long_factor"), n, where + ": rope_scaling.long_factor");
    if (r.original_ctx <= 0)
      throw UserError(where +
                      ": longrope scaling needs a positive "
                      "original_max_position_embeddings");
    const double scale = static_cast<double>(c.ctx) / static_cast<double>(r.original_ctx);
    r.attn_factor = values.number(
        "attention_factor",
        scale > 1.0
            ? std::sqrt(1.0 + std::log(scale) / std::log(static_cast<double>(r.original_ctx)))
            : 1.0);
    return r;
  }
  r.factor = values.number("factor", 0.0);
  r.low_freq_factor = values.number("low_freq_factor", 0.0);
  r.high_freq_factor = values.number("high_freq_factor", 0.0);
  if (!(r.factor >= 1.0) || !(r.low_freq_factor > 0.0) ||
      !(r.high_freq_factor > r.low_freq_factor) || r.original_ctx <= 0 ||
      !std::isfinite(r.factor) || !std::isfinite(r.high_freq_factor))
    throw UserError(where +
                    ": rope_scaling of type llama3 needs factor >= 1, 0 < low_freq_factor "
                    "< high_freq_factor and a positive original_max_position_embeddings");
  r.freq_factors = llama3_freq_factors(c.rope_theta, c.rope_dims(), r.factor, r.low_freq_factor,
                                       r.high_freq_factor, r.original_ctx);
  return r;
}

// The layers without RoPE: SmolLM3's no_rope_layers (1 where a layer applies RoPE), or its
// no_rope_layer_interval, or the architecture's step; none for the others.
std::vector<int64_t> hf_no_rope_layers(const ConfigValues& values, const Architecture& arch,
                                       int64_t layers, const std::string& where) {
  std::vector<int64_t> out;
  if (arch.no_rope_layer_step == 0) return out;
  if (const json* list = values.find("no_rope_layers")) {
    if (!list->is_array() || static_cast<int64_t>(list->size()) != layers)
      throw UserError(where + ": no_rope_layers " + json_shown(*list) + " is not a list of " +
                      std::to_string(layers) + " 0s and 1s");
    for (int64_t i = 0; i < layers; ++i) {
      const json& v = (*list)[static_cast<size_t>(i)];
      if (v != 0 && v != 1)
        throw UserError(where + ": no_rope_layers holds " + json_shown(v) + ", not 0 or 1");
      if (v == 0) out.push_back(i);
    }
    return out;
  }
  const int64_t step = values.whole("no_rope_layer_interval").value_or(arch.no_rope_layer_step);
  if (step <= 0)
    throw UserError(where + ": no_rope_layer_interval " + std::to_string(step) +
                    " must be positive");
  for (int64_t i = step - 1; i < layers; i += step) out.push_back(i);
  return out;
}

// Qwen3.5's Gated DeltaNet layers (layer_types' linear_attention, else all but every
// full_attention_interval-th) and their heads (linear_*), its gated attention, and its RoPE
// (rope_parameters: the base, the rotated part of each head, M-RoPE's sections, which text
// rotates as plain RoPE).
void hf_linear_attention(const ConfigValues& values, const Architecture& arch, ModelConfig& c,
                         int64_t layers, const std::string& where) {
  const auto count = [&](const char* key) {
    const std::optional<int64_t> v = values.whole(key);
    if (!v) throw UserError(where + ": no " + key);
    if (*v <= 0 || *v > kMaxLinearCount)
      throw UserError(where + ": " + key + " " + std::to_string(*v) +
                      " must be positive and at most " + std::to_string(kMaxLinearCount));
    return *v;
  };
  c.linear_layers.clear();
  if (const json* types = values.find("layer_types")) {
    if (!types->is_array() || static_cast<int64_t>(types->size()) != layers)
      throw UserError(where + ": layer_types " + json_shown(*types) + " is not a list of " +
                      std::to_string(layers) + " layer types");
    for (int64_t i = 0; i < layers; ++i) {
      const json& t = (*types)[static_cast<size_t>(i)];
      if (t == "linear_attention")
        c.linear_layers.push_back(i);
      else if (t != "full_attention")
        throw UserError(where + ": layer_types holds " + json_shown(t) +
                        ", which cputrain does not compute (it computes linear_attention and "
                        "full_attention)");
    }
  } else {
    const int64_t interval =
        values.whole("full_attention_interval").value_or(arch.linear_attention_step);
    if (interval <= 0)
      throw UserError(where + ": full_attention_interval " + std::to_string(interval) +
                      " must be positive");
    c.linear_layers = linear_layers_between(interval, layers);
  }
  c.linear_conv = count("linear_conv_kernel_dim");
  c.linear_key_dim = count("linear_key_head_dim");
  c.linear_value_dim = count("linear_value_head_dim");
  c.linear_key_heads = count("linear_num_key_heads");
  c.linear_value_heads = count("linear_num_value_heads");
  if (!values.flag("attn_output_gate", true))
    throw UserError(where + ": attn_output_gate false, which cputrain does not compute for " +
                    std::string(arch.name));
  c.attn_output_gate = true;
  if (values.flag("mtp_use_dedicated_embeddings", false))
    throw UserError(where + ": mtp_use_dedicated_embeddings, which cputrain does not read");
  if (const json* rope = values.find("rope_parameters")) {
    if (!rope->is_object())
      throw UserError(where + ": rope_parameters " + json_shown(*rope) + " is not an object");
    const ConfigValues r(*rope, where + ": rope_parameters");
    for (const auto& [key, value] : rope->items())
      if (key != "rope_type" && key != "rope_theta" && key != "partial_rotary_factor" &&
          key != "mrope_section" && key != "mrope_interleaved")
        throw UserError(where + ": rope_parameters." + key + " " + json_shown(value) +
                        ", which cputrain does not read for " + std::string(arch.name));
    if (r.text("rope_type", "default") != "default")
      throw UserError(where + ": rope_parameters.rope_type " + r.text("rope_type", "") +
                      ", which cputrain does not compute (it computes default)");
    c.rope_theta = r.number("rope_theta", c.rope_theta);
  }
}

// Gemma 3's sliding-window layers: the window, every sliding_window_pattern-th layer global (or
// layer_types naming each, which must follow such a pattern), the windowed layers' RoPE base
// (rope_local_base_freq), and the scores' scale (query_pre_attn_scalar^-1/2).
void hf_sliding_window(const ConfigValues& values, const Architecture& arch, ModelConfig& c,
                       const std::string& where) {
  const int64_t window = values.whole("sliding_window").value_or(arch.default_window);
  if (window <= 0)
    throw UserError(where + ": sliding_window " + std::to_string(window) + " must be positive");
  c.swa_pattern = values.whole("sliding_window_pattern").value_or(arch.swa_pattern);
  if (c.swa_pattern <= 0)
    throw UserError(where + ": sliding_window_pattern " + std::to_string(c.swa_pattern) +
                    " must be positive");
  c.sliding_window = window;
  if (const json* types = values.find("layer_types")) {
    if (!types->is_array() || static_cast<int64_t>(types->size()) != c.n_layers)
      throw UserError(where + ": layer_types " + json_shown(*types) + " is not one per layer");
    for (int64_t i = 0; i < c.n_layers; ++i) {
      const json& t = (*types)[static_cast<size_t>(i)];
      const bool windowed = c.windowed_layer(i);
      if (t != (windowed ? "sliding_attention" : "full_attention"))
        throw UserError(where + ": layer_types holds " + json_shown(t) + " for layer " +
                        std::to_string(i) + ", which is not every " +
                        std::to_string(c.swa_pattern) + "th layer global (what cputrain computes)");
    }
  }
  c.rope_theta_swa =
      values.number("rope_local_base_freq",
                    arch.default_rope_theta_swa > 0.0 ? arch.default_rope_theta_swa : c.rope_theta);
  if (const json* base = values.find("rope_local_base_freq");
      base && (!(c.rope_theta_swa > 1.0) || !std::isfinite(c.rope_theta_swa)))
    throw UserError(where + ": rope_local_base_freq " + json_shown(*base) +
                    " must be a number above 1");
  const auto cap = [&](const char* key, float fallback) {
    const json* v = values.find(key);
    if (v && v->is_null()) return 0.0f;
    const double x = values.number(key, fallback);
    if (v && (!(x > 0.0) || !std::isfinite(x)))
      throw UserError(where + ": " + key + " " + json_shown(*v) + " must be positive, or null");
    return static_cast<float>(x);
  };
  if (arch.attn_softcap) c.attn_softcap = cap("attn_logit_softcapping", arch.default_attn_softcap);
  c.final_softcap = cap("final_logit_softcapping", arch.default_final_softcap);
  if (values.find("query_pre_attn_scalar")) {
    const double scalar = values.number("query_pre_attn_scalar", 0.0);
    if (!(scalar > 0.0)) throw UserError(where + ": query_pre_attn_scalar must be positive");
    if (scalar != static_cast<double>(c.head_size()))
      c.attn_scale = static_cast<float>(1.0 / std::sqrt(scalar));
  }
}

// Gemma 4's config.json (gemma4_text): each layer's kind by layer_types (windowed ones in a
// repeating pattern, then one global); the windowed layers' head_dim and num_key_value_heads,
// the global layers' global_head_dim and, where they take k as v (attention_k_eq_v),
// num_global_key_value_heads; rope_parameters by kind (the global layers' proportional RoPE, as
// a factor of 1e30 on each pair that does not rotate); the layers sharing keys and values, the
// double-wide MLPs of those layers, the per-layer embeddings' width, and the experts beside the
// MLP. Sets `hp`'s first layer's values and its layer_shapes for the others.
void hf_gemma4(const ConfigValues& values, const Architecture& arch, FileHyperparameters& hp,
               ModelConfig& c, const std::string& where) {
  if (!hp.n_layers.value) throw UserError(where + ": no num_hidden_layers");
  const int64_t layers = *hp.n_layers.value;
  if (layers <= 0 || layers > kMaxLinearCount)
    throw UserError(where + ": num_hidden_layers " + std::to_string(layers) +
                    " must be a positive count");
  const json* types = values.find("layer_types");
  if (!types || !types->is_array() || static_cast<int64_t>(types->size()) != layers)
    throw UserError(where + ": layer_types " + (types ? json_shown(*types) : "absent") +
                    " is not one per layer");
  std::vector<bool> windowed;
  for (const json& t : *types) {
    if (t != "sliding_attention" && t != "full_attention")
      throw UserError(where + ": layer_types holds " + json_shown(t) +
                      ", which cputrain does not compute for gemma4 (it computes "
                      "sliding_attention and full_attention)");
    windowed.push_back(t == "sliding_attention");
  }
  int64_t pattern = 1;
  while (pattern <= layers && windowed[static_cast<size_t>(pattern - 1)]) ++pattern;
  for (int64_t i = 0; i < layers; ++i)
    if (windowed[static_cast<size_t>(i)] != (i % pattern < pattern - 1))
      throw UserError(where + ": layer_types windows layers in no repeating pattern of windowed " +
                      "layers then one global, which cputrain does not compute (layer " +
                      std::to_string(i) + ")");
  c.sliding_window = values.whole("sliding_window").value_or(arch.default_window);
  if (c.sliding_window <= 0)
    throw UserError(where + ": sliding_window " + std::to_string(c.sliding_window) +
                    " must be positive");
  c.swa_pattern = pattern;
  if (c.swa_pattern == 1) c.sliding_window = c.swa_pattern = 0;
  const bool first_windowed = c.windowed_layer(0);
  const std::optional<int64_t> head_windowed = values.whole("head_dim");
  const std::optional<int64_t> head_global = values.whole("global_head_dim");
  const bool k_as_v = values.flag("attention_k_eq_v", false);
  const std::optional<int64_t> kv_windowed = values.whole("num_key_value_heads");
  const std::optional<int64_t> kv_global =
      k_as_v ? values.whole("num_global_key_value_heads") : kv_windowed;
  if (k_as_v && !kv_global)
    throw UserError(where + ": attention_k_eq_v without num_global_key_value_heads");
  // RoPE by the layers' kind: the base, and the share of each head it rotates.
  const json* rope = values.find("rope_parameters");
  if (!rope || !rope->is_object())
    throw UserError(where + ": rope_parameters " + (rope ? json_shown(*rope) : "absent") +
                    " is not an object of full_attention's and sliding_attention's");
  struct KindRope {
    double theta = 10000.0;
    double partial = 1.0;
    bool proportional = false;
  };
  const auto kind_rope = [&](const char* kind, double theta) {
    const auto it = rope->find(kind);
    KindRope r;
    r.theta = theta;
    if (it == rope->end()) return r;
    const std::string at = where + ": rope_parameters." + kind;
    if (!it->is_object()) throw UserError(at + " " + json_shown(*it) + " is not an object");
    const ConfigValues v(*it, at);
    for (const auto& [key, value] : it->items())
      if (key != "rope_type" && key != "rope_theta" && key != "partial_rotary_factor")
        throw UserError(at + ": " + key + " " + json_shown(value) +
                        ", which cputrain does not read (nothing in config.json is passed over)");
    const std::string type = v.text("rope_type", "default");
    if (type != "default" && type != "proportional")
      throw UserError(at + ": rope_type " + type +
                      ", which cputrain does not compute for gemma4 (it computes default and "
                      "proportional)");
    r.proportional = type == "proportional";
    r.theta = v.number("rope_theta", theta);
    r.partial = v.number("partial_rotary_factor", 1.0);
    if (!(r.theta > 1.0) || !std::isfinite(r.theta))
      throw UserError(at + ": rope_theta " + json_shown(*v.find("rope_theta")) +
                      " must be a number above 1");
    if (!(r.partial > 0.0 && r.partial <= 1.0))
      throw UserError(at + ": partial_rotary_factor " +
                      json_shown(*v.find("partial_rotary_factor")) +
                      " must be above 0 and at most 1");
    return r;
  };
  const KindRope full = kind_rope("full_attention", 1e6);
  const KindRope sliding = kind_rope("sliding_attention", arch.default_rope_theta_swa);
  c.rope_theta = full.theta;
  c.rope_theta_swa = sliding.theta;
  // The rotated dimensions of a head of `head` by `partial` (even, at least 2).
  const auto rotated = [where = std::string(where)](double partial, int64_t head,
                                                    const char* kind) {
    const auto n = static_cast<int64_t>(static_cast<double>(head) * partial);
    if (n < 2 || n % 2 != 0)
      throw UserError(where + ": rope_parameters." + kind + ".partial_rotary_factor does not " +
                      "give an even number of the head's " + std::to_string(head) + " dimensions");
    return n;
  };
  if (first_windowed) {
    hp.head_dim = {"head_dim", head_windowed};
    hp.n_kv_heads = {"num_key_value_heads", kv_windowed};
  } else {
    hp.head_dim = head_global ? FileHyperparameter{"global_head_dim", head_global}
                              : FileHyperparameter{"head_dim", head_windowed};
    hp.n_kv_heads = k_as_v ? FileHyperparameter{"num_global_key_value_heads", kv_global}
                           : FileHyperparameter{"num_key_value_heads", kv_windowed};
  }
  const int64_t shared = values.whole("num_kv_shared_layers").value_or(0);
  if (shared < 0 || shared >= layers)
    throw UserError(where + ": num_kv_shared_layers " + std::to_string(shared) +
                    " must be at least 0 and below num_hidden_layers");
  c.shared_kv_layers = shared;
  c.per_layer_dim = values.whole("hidden_size_per_layer_input").value_or(0);
  if (c.per_layer_dim < 0 || c.per_layer_dim > kMaxLinearCount)
    throw UserError(where + ": hidden_size_per_layer_input " + std::to_string(c.per_layer_dim) +
                    " is not a count cputrain reads");
  if (c.per_layer_dim > 0 && hp.vocab.value)
    if (const std::optional<int64_t> v = values.whole("vocab_size_per_layer_input");
        v && *v != *hp.vocab.value)
      throw UserError(where + ": vocab_size_per_layer_input " + std::to_string(*v) +
                      " differs from vocab_size " + std::to_string(*hp.vocab.value) +
                      ", which cputrain does not compute");
  const bool double_wide = values.flag("use_double_wide_mlp", false);
  if (values.flag("enable_moe_block", false)) {
    const char* width = values.find("expert_intermediate_size") ? "expert_intermediate_size"
                                                                : "moe_intermediate_size";
    hp.n_experts = {"num_experts", values.whole("num_experts")};
    hp.experts_used = {"top_k_experts", values.whole("top_k_experts")};
    hp.expert_ffn = {width, values.whole(width)};
    for (const FileHyperparameter* r : {&hp.n_experts, &hp.experts_used, &hp.expert_ffn})
      if (!r->value) throw UserError(where + ": enable_moe_block without " + r->key);
  }
  const bool moe = hp.n_experts.value.has_value();
  // Read as one parameter of the model as Transformers holds them (each expert's gate and up rows
  // in one tensor), and written back so, as the converter writes them.
  c.experts_gate_up_fused = moe;
  // Proportional RoPE on the windowed layers (frequency factors the model holds for the global
  // layers' alone) rotates part of each head by another rule than partial rotation.
  if (sliding.proportional && sliding.partial < 1.0)
    throw UserError(where +
                    ": rope_parameters.sliding_attention is proportional with "
                    "partial_rotary_factor " +
                    json_shown(*rope->at("sliding_attention").find("partial_rotary_factor")) +
                    ", which cputrain does not compute (it computes it on full_attention's)");
  hp.rope_dim = {"rope_parameters", std::nullopt};
  if (first_windowed && head_windowed && !sliding.proportional)
    hp.rope_dim.value = rotated(sliding.partial, *head_windowed, "sliding_attention");
  hp.layer_shapes = [=, where = std::string(where)](ModelConfig& m) {
    // The first layer's are the windowed layers' where it is one; the global layers' as given.
    if (first_windowed) {
      m.head_dim_swa = m.head_size();
      m.n_kv_heads_swa = m.kv_heads();
      m.rope_dim_swa = m.rope_dim > 0 ? m.rope_dim : m.head_dim_swa;
      if (head_global) m.head_dim = *head_global;
      if (kv_global) m.n_kv_heads = *kv_global;
    }
    if (m.head_dim <= 0 || m.head_dim > kMaxLinearCount || m.n_kv_heads <= 0 ||
        m.n_kv_heads > m.n_heads || m.n_heads % m.n_kv_heads != 0)
      throw UserError(where +
                      ": the global layers' head size or key/value heads (global_head_dim, "
                      "num_global_key_value_heads) do not fit together");
    const int64_t head = m.head_size();
    if (full.proportional) {
      // Pairs from the first rotate as a full head's would; the others do not.
      m.rope_dim = 0;
      const int64_t pairs = rotated(full.partial, head, "full_attention") / 2;
      std::vector<float> factors(static_cast<size_t>(head / 2), 1e30f);
      std::fill_n(factors.begin(), pairs, 1.0f);
      if (pairs < head / 2) m.rope_scaling = rope_scaling_of_factors(std::move(factors), m);
    } else {
      m.rope_dim = rotated(full.partial, head, "full_attention");
    }
    if (m.rope_dim == head) m.rope_dim = 0;
    if (m.rope_dim_swa == m.head_dim_swa) m.rope_dim_swa = 0;
    if (m.head_dim_swa == head) m.head_dim_swa = 0;
    if (m.n_kv_heads_swa == m.kv_heads()) m.n_kv_heads_swa = 0;
    if (double_wide && shared > 0) {
      m.layer_ffn.assign(static_cast<size_t>(m.n_layers), m.ffn);
      for (int64_t i = m.n_layers - shared; i < m.n_layers; ++i)
        m.layer_ffn[static_cast<size_t>(i)] = 2 * m.ffn;
    }
    for (int64_t i = 0; i < m.n_layers; ++i) {
      if (k_as_v && !m.windowed_layer(i) && m.kv_layer(i) == i) m.k_as_v = true;
      // A shared layer reads the last layer of its kind before the shared ones (Transformers'),
      // which is the one llama.cpp reads where the layers before them end windowed, global.
      int64_t source = -1;
      for (int64_t j = 0; j < m.n_layers - shared; ++j)
        if (m.windowed_layer(j) == m.windowed_layer(i)) source = j;
      if (m.kv_layer(i) != i && m.kv_layer(i) != source)
        throw UserError(where + ": num_kv_shared_layers " + std::to_string(shared) +
                        " leaves layer " + std::to_string(i) +
                        " reading keys and values of a layer whose kind's last before the "
                        "shared ones is not the layer llama.cpp reads, which cputrain does not "
                        "compute");
    }
  };
  c.final_softcap = values.has_null("final_logit_softcapping") ? 0.0f : arch.default_final_softcap;
  if (const json* cap = values.find("final_logit_softcapping")) {
    const double x = values.number("final_logit_softcapping", 0.0);
    if (!(x > 0.0) || !std::isfinite(x))
      throw UserError(where + ": final_logit_softcapping " + json_shown(*cap) +
                      " must be positive, or null");
    c.final_softcap = static_cast<float>(x);
  }
}

}  // namespace

ModelConfig hf_model_config(const std::string& folder, int64_t max_ctx) {
  return hf_model_config(folder, hf_weights(folder), max_ctx);
}

namespace {

// The architecture whose text model an image-and-text config.json of model_type `type` holds
// (in text_config); null where none.
const Architecture* hf_multimodal_architecture(const json& j) {
  if (!j.is_object() || !j.contains("text_config") || !j["text_config"].is_object()) return nullptr;
  const auto type = j.find("model_type");
  if (type == j.end() || !type->is_string()) return nullptr;
  for (const Architecture& a : architectures())
    for (const std::string_view t : a.hf_multimodal_types)
      if (t == type->get<std::string>()) return &a;
  return nullptr;
}

}  // namespace

SafetensorsModel hf_weights(const std::string& folder, std::string* left_out) {
  SafetensorsModel weights(folder);
  const fs::path path = fs::path(folder) / "config.json";
  const json j = fs::exists(path) ? read_json(path) : json();
  // A mixture's experts, one tensor each in the folder (or, as Transformers 5 writes them, gate
  // and up fused in one tensor of all experts; or gpt-oss's), as the one tensor of them all the
  // model holds.
  const Architecture* arch =
      j.is_object() && j.contains("model_type") && j["model_type"].is_string()
          ? find_hf_architecture(j["model_type"].get<std::string>())
          : nullptr;
  // Gemma 4's fused experts are one parameter of the model (ModelConfig::experts_gate_up_fused).
  const Architecture* fused = arch ? arch : hf_multimodal_architecture(j);
  if (arch && arch->hf_gpt_oss_experts)
    weights.split_gpt_oss_experts();
  else
    weights.split_fused_experts(fused && fused->experts_beside_mlp);
  weights.stack_experts();
  std::vector<std::string> parts;
  int64_t n = 0;
  const bool multimodal = hf_multimodal_architecture(j) != nullptr;
  if (multimodal) {
    weights.rename_prefix("model.language_model.", "model.");
    int64_t vision = 0, audio = 0;
    for (const char* prefix : {"model.visual.", "model.vision_tower.", "model.embed_vision."})
      vision += weights.leave_out(prefix);
    for (const char* prefix : {"model.audio_tower.", "model.embed_audio."})
      audio += weights.leave_out(prefix);
    for (const auto& [model, count] :
         {std::pair{"its vision model", vision}, std::pair{"its audio model", audio}})
      if (count > 0) {
        parts.push_back(model);
        n += count;
      }
  }
  // A multi-token-prediction block where the config declares one (Qwen3.5's
  // mtp_num_hidden_layers); elsewhere its tensors have no place, as any other.
  const json& text = multimodal ? j["text_config"] : j;
  const auto declared = text.is_object() ? text.find("mtp_num_hidden_layers") : text.end();
  if (text.is_object() && declared != text.end() && declared->is_number_integer() &&
      declared->get<int64_t>() > 0) {
    if (const int64_t mtp = weights.leave_out("mtp."); mtp > 0) {
      parts.push_back("multi-token prediction");
      n += mtp;
    }
  }
  // Gemma 4's layers sharing keys and values compute none: a checkpoint's k and v projections
  // and norms of theirs are left out, as Transformers leaves them.
  const Architecture* text_arch = multimodal ? hf_multimodal_architecture(j) : arch;
  if (text.is_object() && text_arch && text_arch->layer_shapes) {
    const auto count = [&](const char* key) {
      const auto it = text.find(key);
      return it != text.end() && it->is_number_integer() ? it->get<int64_t>() : int64_t{0};
    };
    const int64_t layers = count("num_hidden_layers"), shared = count("num_kv_shared_layers");
    int64_t unused = 0;
    for (int64_t i = std::max<int64_t>(0, layers - shared); i < layers && shared > 0; ++i)
      for (const char* part : {"k_proj.", "v_proj.", "k_norm.", "v_norm."})
        unused += weights.leave_out("model.layers." + std::to_string(i) + ".self_attn." + part);
    if (unused > 0) {
      parts.push_back("the shared-KV layers' own k and v");
      n += unused;
    }
  }
  if (left_out) {
    left_out->clear();
    std::string listed;
    for (size_t i = 0; i < parts.size(); ++i)
      listed += (i == 0 ? "" : i + 1 == parts.size() ? " and " : ", ") + parts[i];
    if (!parts.empty())
      *left_out = " (" + listed + ", " + std::to_string(n) + " tensors, left out)";
  }
  return weights;
}

ModelConfig hf_model_config(const std::string& folder, const SafetensorsModel& weights,
                            int64_t max_ctx) {
  const fs::path path = fs::path(folder) / "config.json";
  json j = read_json(path);
  const std::string where = path.string();
  if (!j.is_object()) throw UserError(where + ": not a JSON object");
  // An image-and-text model whose text model cputrain reads: its text_config, with the head's
  // tie where the wrapper gives it.
  if (hf_multimodal_architecture(j)) {
    json text = j["text_config"];
    if (!text.contains("tie_word_embeddings") && j.contains("tie_word_embeddings"))
      text["tie_word_embeddings"] = j["tie_word_embeddings"];
    j = std::move(text);
  }
  const ConfigValues values(j, where);
  const std::string type = values.text("model_type", "");
  const Architecture* arch = find_hf_architecture(type);
  if (!arch && j.contains("text_config") && j.contains("vision_config"))
    throw UserError(where + ": model_type " + type +
                    " is an image-and-text model, whose text model cputrain does not read from "
                    "it (llama.cpp's convert_hf_to_gguf.py writes the text model as GGUF, which "
                    "it reads)");
  if (!arch)
    throw UserError(where + ": model_type " + type +
                    ", which cputrain does not compute (it computes " + hf_model_type_names() +
                    ")");
  require_files(*arch, where);
  for (const auto& [key, value] : j.items())
    if (!hf_key_known(*arch, key))
      throw UserError(where + ": " + key + " " + json_shown(value) +
                      ", which cputrain does not read for model_type " + type +
                      " (nothing in config.json is passed over)");
  // The MLP's activation: SiLU, or GELU's tanh approximation (gelu_pytorch_tanh, Phi's
  // gelu_new), which Hugging Face's Gemma computes whether hidden_act says gelu or
  // gelu_pytorch_tanh (its hidden_activation decides).
  const bool gelu = arch->mlp != Mlp::SwiGlu;
  for (const char* key : {"hidden_act", "hidden_activation"}) {
    const std::string act = values.text(key, gelu ? "gelu_pytorch_tanh" : "silu");
    const bool known = gelu ? act == "gelu_pytorch_tanh" || act == "gelu_new" ||
                                  (act == "gelu" && arch->mlp == Mlp::GeGlu &&
                                   std::string_view(key) == "hidden_act")
                            : act == "silu";
    if (!known)
      throw UserError(where + ": " + key + " " + act + ", which cputrain does not compute for " +
                      type + " (it computes " + (gelu ? "gelu_pytorch_tanh" : "silu") + ")");
  }
  if (values.flag("qk_layernorm", false))
    throw UserError(where + ": qk_layernorm, which cputrain does not compute for " + type);
  if (values.flag("mlp_bias", false))
    throw UserError(where + ": mlp_bias, which cputrain does not compute");
  if (values.number("attention_dropout", 0.0) != 0.0)
    throw UserError(where + ": attention_dropout " + json_shown(*values.find("attention_dropout")) +
                    ", which cputrain does not compute (it computes 0)");
  if (const json* layer_types = values.find("layer_types");
      layer_types && arch->swa_pattern == 0 && arch->linear_attention_step == 0)
    for (const json& t : *layer_types)
      if (t != "full_attention")
        throw UserError(where + ": layer_types holds " + json_shown(t) +
                        ", which cputrain does not compute (it computes full_attention)");
  // Soft-capping: Gemma 2's attention scores and final logits, Gemma 3's final logits.
  for (const char* cap : {"final_logit_softcapping", "attn_logit_softcapping"}) {
    const json* v = values.find(cap);
    const bool attn = std::string_view(cap) == "attn_logit_softcapping";
    if (!v || v->is_null() || (attn ? arch->attn_softcap : arch->swa_pattern > 0)) continue;
    throw UserError(where + ": " + cap + " " + json_shown(*v) +
                    ", which cputrain does not compute for " + type);
  }
  // Gemma 4's "vision": bidirectional among an image's tokens, causal over text.
  if (const json* both = values.find("use_bidirectional_attention");
      both && !(arch->layer_shapes && *both == "vision") && *both != false)
    throw UserError(where + ": use_bidirectional_attention " + json_shown(*both) +
                    ", which cputrain does not compute");
  FileHyperparameters hp;
  hp.where = where;
  hp.naming = TensorNaming::HuggingFace;
  for (const auto& [field, key] : {std::pair{&hp.vocab, "vocab_size"},
                                   {&hp.d_model, "hidden_size"},
                                   {&hp.n_layers, "num_hidden_layers"},
                                   {&hp.n_heads, "num_attention_heads"},
                                   {&hp.n_kv_heads, "num_key_value_heads"},
                                   {&hp.head_dim, "head_dim"},
                                   {&hp.ffn, "intermediate_size"},
                                   {&hp.ctx, "max_position_embeddings"}})
    *field = FileHyperparameter{key, values.whole(key)};
  for (const FileHyperparameter* required :
       {&hp.vocab, &hp.d_model, &hp.n_layers, &hp.n_heads, &hp.ffn})
    if (!required->value) throw UserError(where + ": no " + required->key);
  if (!hp.ctx.value) hp.ctx.value = 2048;
  ModelConfig c;
  c.architecture = std::string(arch->name);
  c.norm_eps =
      static_cast<float>(arch->norm == Norm::LayerNorm ? values.number("layer_norm_eps", 1e-5)
                                                       : values.number("rms_norm_eps", 1e-6));
  c.rope_theta = values.number("rope_theta", 10000.0);
  c.tie_embeddings = values.flag("tie_word_embeddings", arch->always_tied);
  c.norm_plus_one = arch->hf_norm_plus_one;
  // Hugging Face's attention_bias also gives o_proj a bias, which no architecture here has: its
  // tensor is refused as having no place.
  c.qkv_bias = arch->qkv_bias == Presence::Always ||
               (arch->qkv_bias == Presence::Optional && values.flag("attention_bias", false));
  c.qk_norm = arch->qk_norm;
  c.rope_pairs = RopePairs::HalfSplit;
  if (arch->linear_attention_step > 0 && hp.n_layers.value)
    hf_linear_attention(values, *arch, c, *hp.n_layers.value, where);
  if (arch->layer_shapes) hf_gemma4(values, *arch, hp, c, where);
  if (arch->moe) {
    // Qwen3-MoE's: every layer's MLP a mixture (decoder_sparse_step 1, no mlp_only_layers), its
    // experts of moe_intermediate_size, the top k weights renormalised where norm_topk_prob.
    // gpt-oss's: num_local_experts of intermediate_size, the clamped SwiGLU's limit 7.
    const bool gpt_oss = arch->hf_gpt_oss_experts;
    const char* width = gpt_oss ? "intermediate_size" : "moe_intermediate_size";
    const char* count = gpt_oss ? "num_local_experts" : "num_experts";
    const char* used = gpt_oss && !values.find("num_experts_per_tok") ? "experts_per_token"
                                                                      : "num_experts_per_tok";
    hp.ffn = FileHyperparameter{width, values.whole(width)};
    hp.n_experts = FileHyperparameter{count, values.whole(count)};
    hp.experts_used = FileHyperparameter{used, values.whole(used)};
    if (gpt_oss && values.number("swiglu_limit", kernels::kSiluClampedLimit) !=
                       static_cast<double>(kernels::kSiluClampedLimit))
      throw UserError(where + ": swiglu_limit " + json_shown(*values.find("swiglu_limit")) +
                      ", which cputrain does not compute (it computes 7)");
    if (arch->shared_expert)
      hp.shared_expert_ffn = FileHyperparameter{"shared_expert_intermediate_size",
                                                values.whole("shared_expert_intermediate_size")};
    std::vector<const FileHyperparameter*> required{&hp.ffn, &hp.n_experts, &hp.experts_used};
    if (arch->shared_expert) required.push_back(&hp.shared_expert_ffn);
    for (const FileHyperparameter* r : required)
      if (!r->value) throw UserError(where + ": no " + r->key);
    if (const std::optional<int64_t> step = values.whole("decoder_sparse_step"); step && *step != 1)
      throw UserError(where + ": decoder_sparse_step " + std::to_string(*step) +
                      ": dense MLP layers among the mixtures, which cputrain does not compute");
    if (const json* dense = values.find("mlp_only_layers");
        dense && !(dense->is_array() && dense->empty()))
      throw UserError(where + ": mlp_only_layers " + json_shown(*dense) +
                      ": dense MLP layers among the mixtures, which cputrain does not compute");
    // Transformers' default: Qwen3-MoE's router leaves its top k as they are, Qwen3.5-MoE's
    // (with the shared expert) renormalises them.
    c.expert_weights_norm = values.flag("norm_topk_prob", arch->shared_expert);
  }
  check_file_hyperparameters(
      hp, weights.names(),
      [&](const std::string& name) -> std::optional<std::vector<int64_t>> {
        const SafetensorsTensor* t = weights.find(name);
        if (!t) return std::nullopt;
        return t->shape;
      },
      c);
  // Partial rotary (Phi-4-mini): RoPE on the first partial_rotary_factor of each head (Qwen3.5
  // gives it among rope_parameters).
  const json* rope_parameters = values.find("rope_parameters");
  const bool among = arch->linear_attention_step > 0 && rope_parameters &&
                     rope_parameters->is_object() &&
                     rope_parameters->contains("partial_rotary_factor");
  const ConfigValues partial_values(among ? *rope_parameters : j,
                                    among ? where + ": rope_parameters" : where);
  const double partial = partial_values.number("partial_rotary_factor", 1.0);
  if (partial != 1.0) {
    const auto rope = static_cast<int64_t>(static_cast<double>(c.head_size()) * partial);
    if (!arch->partial_rotary)
      throw UserError(where + ": partial_rotary_factor " +
                      json_shown(*partial_values.find("partial_rotary_factor")) +
                      ", which cputrain does not compute for " + type);
    if (!(partial > 0.0 && partial < 1.0) || rope <= 0 || rope % 2 != 0)
      throw UserError(where + ": partial_rotary_factor " +
                      json_shown(*partial_values.find("partial_rotary_factor")) +
                      " does not give an even number of the head's " +
                      std::to_string(c.head_size()) + " dimensions");
    c.rope_dim = rope;
  }
  for (const char* dropout : {"resid_pdrop", "embd_pdrop"})
    if (values.number(dropout, 0.0) != 0.0)
      throw UserError(where + ": " + dropout + " " + json_shown(*values.find(dropout)) +
                      ", which cputrain does not compute (it computes 0)");
  if (const json* scaling = values.find("rope_scaling"))
    c.rope_scaling = hf_rope_scaling(*scaling, values, *arch, c, where);
  c.no_rope_layers = hf_no_rope_layers(values, *arch, c.n_layers, where);
  if (arch->layer_shapes) {
    // hf_gemma4's.
  } else if (arch->swa_pattern > 0) {
    hf_sliding_window(values, *arch, c, where);
  } else if (values.flag("use_sliding_window", type == "mistral" || type == "phi3")) {
    if (const std::optional<int64_t> window = values.whole("sliding_window")) {
      if (*window <= 0)
        throw UserError(where + ": sliding_window " + std::to_string(*window) +
                        " must be positive");
      c.ctx = std::min(c.ctx, *window);
    }
  }
  c.ctx = std::min(c.ctx, max_ctx);
  if (const auto problem = validate(c))
    throw UserError(where + ": the model's hyperparameters do not fit together: " + problem->str());
  return c;
}

namespace {

// Whether parameter `info`'s values are not its rows of the file's tensor as they lie: q and gate
// interleaved head by head, or Gated DeltaNet's value heads in another order.
bool reordered_part(const ParameterInfo& info, const ModelConfig& c) {
  return interleaved_part(info, c) || value_heads_reordered(info, c);
}

}  // namespace

InPlaceWeight hf_in_place(const SafetensorsModel& weights, const ParameterInfo& parameter,
                          const ModelConfig& config) {
  const TensorPart part = tensor_part(parameter, config, TensorNaming::HuggingFace);
  const SafetensorsTensor* t = weights.find(part.name);
  if (!t || t->dtype != "BF16" || reordered_part(parameter, config)) return {};
  if (t->shape != file_tensor_shape(parameter, part, TensorNaming::HuggingFace) ||
      t->data.size() != static_cast<size_t>(t->numel()) * 2)
    return {};
  const int64_t row = parameter.shape.numel() / parameter.shape[0];
  return {t->data.data() + part.first_row * row * 2, DType::BF16};
}

namespace {

// The folder's tensor holding parameter `info` (of a DecoderModel of `config`), of its shape (its
// parts' together, for a fused tensor) and of a dtype cputrain reads; a UserError naming the file
// and tensor otherwise. `part` receives where in it the parameter's rows are.
const SafetensorsTensor& hf_tensor_of(const SafetensorsModel& weights, const ParameterInfo& info,
                                      const ModelConfig& config, TensorPart* part = nullptr) {
  const TensorPart where = tensor_part(info, config, TensorNaming::HuggingFace);
  const std::string& name = where.name;
  const SafetensorsTensor* t = weights.find(name);
  if (!t) throw UserError("the model's safetensors have no tensor " + name);
  const std::vector<int64_t> expected = file_tensor_shape(info, where, TensorNaming::HuggingFace);
  if (t->shape != expected)
    throw UserError(weights.file_of(name) + ": tensor " + name + " has shape " +
                    shape_text(t->shape) + " where config.json gives " + shape_text(expected));
  if (t->dtype != "F32" && t->dtype != "F16" && t->dtype != "BF16")
    throw UserError(weights.file_of(name) + ": tensor " + name + " is " + t->dtype +
                    ", a dtype cputrain does not read (F32, F16, BF16)");
  if (part) *part = where;
  return *t;
}

// Every tensor of the folder is one of `used`'s (a tied model's folder may hold the head as well;
// rotary tables are derived, not weights); a UserError naming the first that is not.
void check_no_other_tensors(const SafetensorsModel& weights, const std::set<std::string>& used) {
  for (const std::string& name : weights.names()) {
    if (used.count(name) || name == "lm_head.weight" || name.ends_with("rotary_emb.inv_freq"))
      continue;
    throw UserError(weights.file_of(name) + ": tensor " + name +
                    " has no place in the model cputrain computes");
  }
}

}  // namespace

void check_hf_weights(const SafetensorsModel& weights, const ModelConfig& config) {
  ParameterSet declared;
  DecoderModel::declare_parameters(config, declared);
  std::set<std::string> used;
  for (const ParameterInfo& info : declared.infos()) {
    TensorPart part;
    hf_tensor_of(weights, info, config, &part);
    used.insert(part.name);
  }
  check_no_other_tensors(weights, used);
}

void load_hf_weights(const SafetensorsModel& weights, const ParameterSet& params,
                     const ModelConfig& config) {
  std::set<std::string> used;
  // A fused tensor's parts follow one another: it is converted once for them all.
  const SafetensorsTensor* converted = nullptr;
  std::vector<float> values;
  for (size_t i = 0; i < params.infos().size(); ++i) {
    const ParameterInfo& info = params.infos()[i];
    if (is_lora_parameter(info.name)) continue;  // adapters are not the file's
    TensorPart part;
    const SafetensorsTensor* t = &hf_tensor_of(weights, info, config, &part);
    const std::string& name = part.name;
    const int64_t row = info.shape.numel() / info.shape[0];
    // A BF16 tensor into a parameter held as bf16 alone is read in place or copied as it is.
    if (params.mapped(static_cast<int>(i))) {
      if (t->dtype != "BF16")
        throw std::logic_error("load_hf_weights: " + name + " mapped but not BF16");
    } else if (t->dtype == "BF16" && params.bf16_only(static_cast<int>(i)) &&
               !reordered_part(info, config)) {
      params.write_bf16_values(static_cast<int>(i), t->data.data() + part.first_row * row * 2);
    } else {
      if (converted != t) values = safetensors_values(weights.file_of(name), name, *t);
      converted = t;
      std::vector<float> mine = part_values(values, info, part, config);
      reorder_value_heads(mine, info, config, false);
      params.write_values(static_cast<int>(i), mine.data());
    }
    used.insert(name);
  }
  check_no_other_tensors(weights, used);
}
}  // namespace cputrain
