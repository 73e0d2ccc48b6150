#include "models/hf_model.h"

#include <spdlog/fmt/fmt.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <stdexcept>
#include <unordered_map>

#include "engine/core/error.h"
#include "engine/io/atomic_file.h"
#include "engine/io/gguf_file.h"
#include "engine/text/tokenizer.h"
#include "engine/train/parameters.h"
#include "models/architecture.h"
#include "models/decoder.h"
#include "models/file_hyperparameters.h"
#include "models/lora.h"
#include "models/tensor_names.h"

namespace cputrain {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// The pre-tokenizer regular expressions of Hugging Face's tokenizer.json files, by the name
// llama.cpp gives them.
constexpr std::pair<const char*, const char*> kHfPreTokenizers[] = {
    {"llama-bpe",
     "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
     "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
    {"qwen2",
     "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
     "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
};

json read_json(const fs::path& path) {
  std::ifstream in(path);
  if (!in) throw UserError(path.string() + ": cannot be read");
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    throw UserError(path.string() + ": malformed JSON (" + std::string(e.what()) + ")");
  }
}

// Every object of `type` in a (possibly nested Sequence) component such as pre_tokenizer.
void collect(const json& component, const std::string& type, std::vector<json>& out) {
  if (!component.is_object()) return;
  if (component.value("type", "") == type) out.push_back(component);
  for (const char* list : {"pretokenizers", "normalizers", "decoders"})
    if (component.contains(list))
      for (const json& c : component[list]) collect(c, type, out);
}

// A special token's text in tokenizer_config.json: a string or {"content": ...}.
std::string token_text(const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object()) return v.value("content", "");
  return "";
}

}  // namespace

bool is_hf_folder(const std::string& folder) {
  const fs::path config = fs::path(folder) / "config.json";
  if (!fs::exists(config)) return false;
  std::ifstream in(config);
  const json j = json::parse(in, nullptr, false);
  return j.is_object() && j.contains("model_type");
}

namespace {

// What a JSON value is, for a message: "a string", "a fraction", ...
std::string json_kind(const json& v) {
  if (v.is_string()) return "a string";
  if (v.is_boolean()) return "true or false";
  if (v.is_number_float()) return "a fraction";
  if (v.is_array()) return "an array";
  if (v.is_object()) return "an object";
  return "null";
}

// A value of config.json as a message shows it: its JSON, shortened.
std::string json_shown(const json& v) {
  std::string s = v.dump();
  if (s.size() > 40) s = s.substr(0, 37) + "...";
  return s;
}

// The typed values of config.json: a UserError naming the file and key for a value of another
// type; absent (or null) where the key is not there.
class ConfigValues {
 public:
  ConfigValues(const json& j, std::string where) : j_(j), where_(std::move(where)) {}

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
      : type == "linear"
          ? std::vector<std::string_view>{"rope_type", "type", "factor"}
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

}  // namespace

ModelConfig hf_model_config(const std::string& folder, int64_t max_ctx) {
  return hf_model_config(folder, SafetensorsModel(folder), max_ctx);
}

ModelConfig hf_model_config(const std::string& folder, const SafetensorsModel& weights,
                            int64_t max_ctx) {
  const fs::path path = fs::path(folder) / "config.json";
  const json j = read_json(path);
  const std::string where = path.string();
  if (!j.is_object()) throw UserError(where + ": not a JSON object");
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
  if (const json* layer_types = values.find("layer_types"); layer_types && arch->swa_pattern == 0)
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
  if (values.flag("use_bidirectional_attention", false))
    throw UserError(where + ": use_bidirectional_attention, which cputrain does not compute");
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
  check_file_hyperparameters(
      hp, weights.names(),
      [&](const std::string& name) -> std::optional<std::vector<int64_t>> {
        const SafetensorsTensor* t = weights.find(name);
        if (!t) return std::nullopt;
        return t->shape;
      },
      c);
  // Partial rotary (Phi-4-mini): RoPE on the first partial_rotary_factor of each head.
  const double partial = values.number("partial_rotary_factor", 1.0);
  if (partial != 1.0) {
    const auto rope = static_cast<int64_t>(static_cast<double>(c.head_size()) * partial);
    if (!arch->partial_rotary)
      throw UserError(where + ": partial_rotary_factor " +
                      json_shown(*values.find("partial_rotary_factor")) +
                      ", which cputrain does not compute for " + type);
    if (!(partial > 0.0 && partial < 1.0) || rope <= 0 || rope % 2 != 0)
      throw UserError(where + ": partial_rotary_factor " +
                      json_shown(*values.find("partial_rotary_factor")) +
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
  if (arch->swa_pattern > 0) {
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

InPlaceWeight hf_in_place(const SafetensorsModel& weights, const ParameterInfo& parameter,
                          const ModelConfig& config) {
  const TensorPart part = tensor_part(parameter, config, TensorNaming::HuggingFace);
  const SafetensorsTensor* t = weights.find(part.name);
  if (!t || t->dtype != "BF16") return {};
  std::vector<int64_t> shape;
  for (int d = 0; d < parameter.shape.ndim(); ++d) shape.push_back(parameter.shape[d]);
  shape[0] = part.tensor_rows;
  if (t->shape != shape || t->data.size() != static_cast<size_t>(t->numel()) * 2) return {};
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
  std::vector<int64_t> expected;
  for (int d = 0; d < info.shape.ndim(); ++d) expected.push_back(info.shape[d]);
  expected[0] = where.tensor_rows;
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
    } else if (t->dtype == "BF16" && params.bf16_only(static_cast<int>(i))) {
      params.write_bf16_values(static_cast<int>(i), t->data.data() + part.first_row * row * 2);
    } else {
      if (converted != t) values = safetensors_values(weights.file_of(name), name, *t);
      converted = t;
      params.write_values(static_cast<int>(i), values.data() + part.first_row * row);
    }
    used.insert(name);
  }
  check_no_other_tensors(weights, used);
}

Tokenizer hf_tokenizer(const std::string& folder) {
  const fs::path dir(folder);
  const json config = fs::exists(dir / "tokenizer_config.json")
                          ? read_json(dir / "tokenizer_config.json")
                          : json::object();
  const fs::path path = dir / "tokenizer.json";
  if (!fs::exists(path)) {
    if (fs::exists(dir / "tokenizer.model"))
      return Tokenizer::load((dir / "tokenizer.model").string());
    throw UserError(folder + ": no tokenizer (tokenizer.json or tokenizer.model)");
  }
  const json j = read_json(path);
  const std::string where = path.string();
  const json& model = j.contains("model") ? j["model"] : json();
  if (!model.is_object() || model.value("type", "") != "BPE")
    throw UserError(where + ": a tokenizer of type " +
                    (model.is_object() ? model.value("type", "?") : std::string("?")) +
                    ", which cputrain does not read (it reads BPE)");
  std::vector<json> byte_level;
  collect(j.value("pre_tokenizer", json()), "ByteLevel", byte_level);
  const bool spm = byte_level.empty();
  // SentencePiece-style vocabularies: their own SentencePiece model is the reference.
  if (spm && fs::exists(dir / "tokenizer.model"))
    return Tokenizer::load((dir / "tokenizer.model").string());
  Vocabulary v;
  v.model = spm ? "llama" : "gpt2";
  try {
    // Ids may leave gaps, never more than the tokens listed, many times over, could fill.
    const json added = j.value("added_tokens", json::array());
    const auto listed = static_cast<int64_t>(model.at("vocab").size() + added.size());
    const int64_t most = std::max<int64_t>(1024, 4 * listed);
    const auto id_of = [&](const json& id) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= most)
        throw UserError(where + ": token id " + json_shown(id) + " is not one of 0 to " +
                        std::to_string(most - 1) + " (" + std::to_string(listed) +
                        " tokens are listed)");
      return static_cast<size_t>(id.get<int64_t>());
    };
    size_t size = 0;
    for (const auto& [token, id] : model.at("vocab").items()) size = std::max(size, id_of(id) + 1);
    for (const json& t : added) size = std::max(size, id_of(t.at("id")) + 1);
    v.tokens.assign(size, "");
    v.types.assign(size, Vocabulary::kUnused);
    for (const auto& [token, id] : model.at("vocab").items()) {
      v.tokens[id_of(id)] = token;
      v.types[id_of(id)] = Vocabulary::kNormal;
    }
    for (const json& t : added) {
      const size_t id = id_of(t.at("id"));
      v.tokens[id] = t.at("content").get<std::string>();
      v.types[id] = t.value("special", false) ? Vocabulary::kControl : Vocabulary::kUserDefined;
      if (t.value("rstrip", false)) {
        v.rstrip.resize(v.tokens.size(), 0);
        v.rstrip[id] = 1;
      }
    }
    for (const json& m : model.value("merges", json::array()))
      v.merges.push_back(m.is_string()
                             ? m.get<std::string>()
                             : m.at(0).get<std::string>() + " " + m.at(1).get<std::string>());
  } catch (const json::exception& e) {
    throw UserError(where + ": " + e.what());
  }
  if (spm) {
    // Pieces merge by score; a BPE vocabulary's merges are ranks: a merged piece scores minus the
    // rank of the merge that makes it.
    v.scores.assign(v.tokens.size(), 0.0f);
    std::unordered_map<std::string, size_t> id_of;
    for (size_t i = 0; i < v.tokens.size(); ++i) id_of.emplace(v.tokens[i], i);
    for (size_t r = 0; r < v.merges.size(); ++r) {
      const std::string& m = v.merges[r];
      const size_t space = m.find(' ');
      const auto it = id_of.find(m.substr(0, space) + m.substr(space + 1));
      if (it != id_of.end() && v.scores[it->second] == 0.0f)
        v.scores[it->second] = -static_cast<float>(r + 1);
    }
    v.merges.clear();
    for (size_t i = 0; i < v.tokens.size(); ++i) {
      const std::string& t = v.tokens[i];
      if (t.size() == 6 && t.starts_with("<0x") && t.back() == '>') v.types[i] = Vocabulary::kByte;
    }
    std::vector<json> prepends;
    collect(j.value("normalizer", json()), "Prepend", prepends);
    std::vector<json> metaspace;
    collect(j.value("pre_tokenizer", json()), "Metaspace", metaspace);
    v.add_space_prefix =
        !prepends.empty() ||
        (!metaspace.empty() && metaspace[0].value("prepend_scheme", "always") != "never");
    if (const auto unk = model.value("unk_token", json()); unk.is_string())
      if (const auto it = id_of.find(unk.get<std::string>()); it != id_of.end()) {
        v.unk = static_cast<int32_t>(it->second);
        v.types[it->second] = Vocabulary::kUnknown;
      }
  } else {
    std::vector<json> splits, digits;
    collect(j.value("pre_tokenizer", json()), "Split", splits);
    collect(j.value("pre_tokenizer", json()), "Digits", digits);
    v.pre = "gpt-2";
    if (!digits.empty()) {  // SmolLM's: each digit apart, then ByteLevel's GPT-2 split
      if (!digits[0].value("individual_digits", false) || !splits.empty())
        throw UserError(where +
                        ": a pre-tokenizer cputrain does not know (Digits without "
                        "individual_digits, or with a Split); it knows those of gpt-2, llama-bpe, "
                        "qwen2 and smollm");
      v.pre = "smollm";
    }
    if (!splits.empty()) {
      const std::string pattern = splits[0].value("pattern", json::object()).value("Regex", "");
      v.pre.clear();
      for (const auto& [name, regex] : kHfPreTokenizers)
        if (pattern == regex) v.pre = name;
      if (v.pre.empty())
        throw UserError(where + ": a pre-tokenizer pattern cputrain does not know (" + pattern +
                        "); it knows those of gpt-2, llama-bpe, qwen2 and smollm");
    }
    v.add_space_prefix = false;
  }
  const auto id_of_text = [&](const json& value) {
    const std::string text = token_text(value);
    if (text.empty()) return int32_t{-1};
    const auto it = std::find(v.tokens.begin(), v.tokens.end(), text);
    return it == v.tokens.end() ? int32_t{-1} : static_cast<int32_t>(it - v.tokens.begin());
  };
  v.bos = id_of_text(config.value("bos_token", json()));
  v.eos = id_of_text(config.value("eos_token", json()));
  if (v.eos < 0) {
    const json model_config = read_json(dir / "config.json");
    if (model_config.contains("eos_token_id") && model_config["eos_token_id"].is_number_integer())
      v.eos = model_config["eos_token_id"].get<int32_t>();
  }
  v.add_bos = config.value("add_bos_token", spm || v.pre == "llama-bpe") && v.bos >= 0;
  v.add_eos = config.value("add_eos_token", false);
  if (config.contains("chat_template") && config["chat_template"].is_string())
    v.chat_template = config["chat_template"].get<std::string>();
  return Tokenizer::from_vocabulary(std::move(v));
}

namespace {

// The merges of a SentencePiece-style vocabulary, for a BPE tokenizer.json: each piece of two
// characters or more, by score, made from the split whose two halves are pieces and rank
// best (the highest-scoring pair).
std::vector<std::string> merges_of(const Vocabulary& v) {
  std::unordered_map<std::string, float> score;
  for (size_t i = 0; i < v.tokens.size(); ++i)
    if (v.types.empty() || v.types[i] == Vocabulary::kNormal)
      score.emplace(v.tokens[i], v.scores.empty() ? 0.0f : v.scores[i]);
  std::vector<std::pair<float, std::string>> merges;
  for (const auto& [piece, s] : score) {
    float best = -std::numeric_limits<float>::infinity();
    std::string chosen;
    for (size_t cut = 1; cut < piece.size(); ++cut) {
      if ((static_cast<unsigned char>(piece[cut]) & 0xC0) == 0x80) continue;  // mid-character
      const auto l = score.find(piece.substr(0, cut)), r = score.find(piece.substr(cut));
      if (l == score.end() || r == score.end()) continue;
      if (l->second + r->second > best) {
        best = l->second + r->second;
        chosen = piece.substr(0, cut) + " " + piece.substr(cut);
      }
    }
    if (!chosen.empty()) merges.emplace_back(s, chosen);
  }
  std::stable_sort(merges.begin(), merges.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<std::string> out;
  for (auto& [s, m] : merges) out.push_back(std::move(m));
  return out;
}

const char* hf_pattern(const std::string& pre) {
  for (const auto& [name, regex] : kHfPreTokenizers)
    if (pre == name) return regex;
  return nullptr;
}

}  // namespace

namespace {

struct SafetensorsEntry {
  std::string name;
  Shape shape;
  std::string dtype;
  std::vector<uint8_t> bytes;
};

// A safetensors file of `entries`, in order, written atomically.
void write_safetensors(const std::string& path, const std::vector<SafetensorsEntry>& entries) {
  json header = json::object();
  uint64_t offset = 0;
  for (const SafetensorsEntry& e : entries) {
    std::vector<int64_t> shape;
    for (int d = 0; d < e.shape.ndim(); ++d) shape.push_back(e.shape[d]);
    header[e.name] = {
        {"dtype", e.dtype}, {"shape", shape}, {"data_offsets", {offset, offset + e.bytes.size()}}};
    offset += e.bytes.size();
  }
  header["__metadata__"] = {{"format", "pt"}};
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  AtomicFileWriter out(path);
  const uint64_t n = text.size();
  out.write(&n, 8);
  out.write(text.data(), text.size());
  for (const SafetensorsEntry& e : entries) out.write(e.bytes.data(), e.bytes.size());
  out.commit();
}

}  // namespace

void write_peft_adapter(const std::string& folder, const ModelConfig& c, const ParameterSet& params,
                        const LoraConfig& lora, const std::string& base) {
  const fs::path dir(folder);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw UserError(folder + ": cannot create (" + ec.message() + ")");
  std::vector<SafetensorsEntry> entries;
  // B's q and k rows in Hugging Face's rotate-half order, as its projections' rows are; a fused
  // projection's parts' B rows one after another.
  for (const FileTensor& t :
       file_tensors(params, c, TensorNaming::HuggingFace,
                    [](const ParameterInfo& info) { return is_lora_parameter(info.name); })) {
    const std::vector<float> values = file_tensor_values(params, t, c, RopePairs::HalfSplit, false);
    entries.push_back({t.name, Shape{t.shape[0], t.shape[1]}, "F32",
                       ggml_from_float(GgmlType::F32, values.data(), t.shape[0] * t.shape[1])});
  }
  if (entries.empty()) throw std::logic_error("write_peft_adapter: a model without adapters");
  write_safetensors((dir / "adapter_model.safetensors").string(), entries);
  // The modules, by the architecture's names (Phi-3's fused qkv_proj and gate_up_proj, Phi-2's
  // dense, fc1, fc2): the last part of each adapted tensor's name, in the order of the first
  // block's.
  json targets = json::array();
  for (const FileTensor& t :
       file_tensors(params, c, TensorNaming::HuggingFace, [](const ParameterInfo& info) {
         return info.name.starts_with("layers.0.") && info.name.ends_with(".lora_b");
       })) {
    const std::string path = t.name.substr(0, t.name.rfind(".lora_B"));
    const std::string module = path.substr(path.rfind('.') + 1);
    if (std::find(targets.begin(), targets.end(), module) == targets.end())
      targets.push_back(module);
  }
  const json config = {{"peft_type", "LORA"},
                       {"task_type", "CAUSAL_LM"},
                       {"base_model_name_or_path", base},
                       {"r", lora.rank},
                       {"lora_alpha", lora.alpha},
                       {"lora_dropout", lora.dropout},
                       {"target_modules", targets},
                       {"bias", "none"},
                       {"fan_in_fan_out", false},
                       {"inference_mode", true},
                       {"init_lora_weights", true},
                       {"modules_to_save", nullptr},
                       {"use_rslora", false},
                       {"use_dora", false}};
  write_file_atomic((dir / "adapter_config.json").string(), config.dump(2) + "\n");
}

void write_hf_folder(const std::string& folder, const ModelConfig& c, const ParameterSet& params,
                     const Tokenizer& tokenizer, const std::string& dtype) {
  const fs::path dir(folder);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw UserError("--out " + folder + ": cannot create (" + ec.message() + ")");
  const Architecture& arch = architecture_of(c);
  if (c.qkv_bias && arch.qkv_bias != Presence::Always)
    throw UserError("a " + std::string(arch.name) + " model with q/k/v biases: Hugging Face's " +
                    std::string(arch.hf_class) +
                    " has none (train it with --arch qwen2, or export it as GGUF)");
  if (c.rope_scaling.type == "factors")
    throw UserError(
        "RoPE frequency factors that are not Llama 3's scaling: config.json has no "
        "rope_scaling for them (export the model as GGUF)");
  const Vocabulary v = tokenizer.to_vocabulary();
  const auto token = [&](int32_t id) {
    return id >= 0 && id < static_cast<int32_t>(v.tokens.size()) ? json(v.tokens[id]) : json();
  };
  json config = {{"architectures", {std::string(arch.hf_class)}},
                 {"model_type", std::string(arch.hf_model_types.front())},
                 {"vocab_size", c.vocab},
                 {"hidden_size", c.d_model},
                 {"num_hidden_layers", c.n_layers},
                 {"num_attention_heads", c.n_heads},
                 {"num_key_value_heads", c.kv_heads()},
                 {"head_dim", c.head_size()},
                 {"intermediate_size", c.ffn},
                 {"rms_norm_eps", std::strtod(fmt::format("{}", c.norm_eps).c_str(), nullptr)},
                 {"rope_theta", c.rope_theta},
                 {"rope_scaling", nullptr},
                 {"max_position_embeddings", c.ctx},
                 {"tie_word_embeddings", c.tie_embeddings},
                 {"hidden_act", arch.mlp == Mlp::SwiGlu  ? "silu"
                                : arch.mlp == Mlp::GeGlu ? "gelu_pytorch_tanh"
                                                         : "gelu_new"},
                 {"attention_bias", false},
                 {"torch_dtype", dtype == "F32"   ? "float32"
                                 : dtype == "F16" ? "float16"
                                                  : "bfloat16"},
                 {"bos_token_id", v.bos >= 0 ? json(v.bos) : json()},
                 {"eos_token_id", v.eos >= 0 ? json(v.eos) : json()}};
  if (arch.qkv_bias == Presence::Always) config.erase("attention_bias");  // implied by the type
  if (arch.mlp == Mlp::GeGlu) config["hidden_activation"] = "gelu_pytorch_tanh";
  if (arch.norm == Norm::LayerNorm) {
    config.erase("rms_norm_eps");
    config["layer_norm_eps"] = std::strtod(fmt::format("{}", c.norm_eps).c_str(), nullptr);
  }
  if (arch.name != "llama" && arch.swa_pattern == 0) config["use_sliding_window"] = false;
  if (arch.swa_pattern > 0) {
    config["sliding_window"] = c.sliding_window > 0 ? json(c.sliding_window) : json();
    // Gemma 3's keys; Gemma 2's pattern and base are fixed (every other layer, the model's).
    if (hf_key_known(arch, "sliding_window_pattern")) {
      config["sliding_window_pattern"] = c.swa_pattern;
      config["rope_local_base_freq"] = c.rope_theta_swa > 0.0 ? c.rope_theta_swa : c.rope_theta;
    }
    // The scale's square's reciprocal, exact where the scale is a power of 2 (a head of 256).
    config["query_pre_attn_scalar"] =
        c.attn_scale > 0.0f
            ? 1.0 / (static_cast<double>(c.attn_scale) * static_cast<double>(c.attn_scale))
            : static_cast<double>(c.head_size());
    config["final_logit_softcapping"] = c.final_softcap > 0.0f ? json(c.final_softcap) : json();
    config["attn_logit_softcapping"] = c.attn_softcap > 0.0f ? json(c.attn_softcap) : json();
  }
  if (c.rope_dim > 0)
    config["partial_rotary_factor"] =
        static_cast<double>(c.rope_dim) / static_cast<double>(c.head_size());
  if (c.rope_scaling.type == "longrope") {
    config["original_max_position_embeddings"] = c.rope_scaling.original_ctx;
    config["rope_scaling"] = {{"type", "longrope"},
                              {"short_factor", c.rope_scaling.freq_factors},
                              {"long_factor", c.rope_scaling.long_factors},
                              {"attention_factor", c.rope_scaling.attn_factor}};
  } else if (c.rope_scaling.type == "linear") {
    config["rope_scaling"] = {{"rope_type", "linear"}, {"factor", c.rope_scaling.factor}};
  } else if (c.rope_scaling.active())
    config["rope_scaling"] = {{"rope_type", c.rope_scaling.type},
                              {"factor", c.rope_scaling.factor},
                              {"low_freq_factor", c.rope_scaling.low_freq_factor},
                              {"high_freq_factor", c.rope_scaling.high_freq_factor},
                              {"original_max_position_embeddings", c.rope_scaling.original_ctx}};
  if (arch.no_rope_layer_step > 0) {
    json layers = json::array();
    for (int64_t i = 0; i < c.n_layers; ++i) layers.push_back(c.rope_in_layer(i) ? 1 : 0);
    config["no_rope_layers"] = layers;
  }
  write_file_atomic((dir / "config.json").string(), config.dump(2) + "\n");

  // model.safetensors: the header, then each tensor's bytes in order.
  const GgmlType type = dtype == "F32"   ? GgmlType::F32
                        : dtype == "F16" ? GgmlType::F16
                                         : GgmlType::BF16;
  std::vector<SafetensorsEntry> entries;
  for (const ParameterInfo& info : params.infos())
    if (is_lora_parameter(info.name))
      throw std::logic_error("write_hf_folder: a model with adapters (merge them first)");
  for (const FileTensor& t : file_tensors(params, c, TensorNaming::HuggingFace,
                                          [](const ParameterInfo&) { return true; })) {
    const std::vector<float> values =
        file_tensor_values(params, t, c, RopePairs::HalfSplit, arch.hf_norm_plus_one);
    Shape shape = t.shape.size() == 1 ? Shape{t.shape[0]} : Shape{t.shape[0], t.shape[1]};
    entries.push_back({t.name, shape, dtype,
                       ggml_from_float(type, values.data(), static_cast<int64_t>(values.size()))});
  }
  write_safetensors((dir / "model.safetensors").string(), entries);

  json tconfig = {{"bos_token", token(v.bos)},  {"eos_token", token(v.eos)},
                  {"unk_token", token(v.unk)},  {"add_bos_token", v.add_bos},
                  {"add_eos_token", v.add_eos}, {"model_max_length", c.ctx}};
  if (!v.chat_template.empty()) tconfig["chat_template"] = v.chat_template;
  if (!tokenizer.vocabulary()) {
    // cputrain's own tokenizer: its SentencePiece model, which Transformers' LlamaTokenizer reads.
    write_file_atomic((dir / "tokenizer.model").string(), tokenizer.model_bytes());
    tconfig["tokenizer_class"] = "LlamaTokenizer";
    tconfig["legacy"] = false;
    tconfig["add_prefix_space"] = v.add_space_prefix;
  } else {
    json vocab = json::object(), added = json::array();
    for (size_t i = 0; i < v.tokens.size(); ++i) {
      const int32_t t = v.types.empty() ? Vocabulary::kNormal : v.types[i];
      if (t == Vocabulary::kControl || t == Vocabulary::kUserDefined)
        added.push_back({{"id", i},
                         {"content", v.tokens[i]},
                         {"special", t == Vocabulary::kControl},
                         {"single_word", false},
                         {"lstrip", false},
                         {"rstrip", !v.rstrip.empty() && v.rstrip[i] != 0},
                         {"normalized", false}});
      vocab[v.tokens[i]] = i;
    }
    json model = {{"type", "BPE"}, {"vocab", vocab}};
    json t = {{"version", "1.0"}, {"added_tokens", added}};
    if (v.model == "gpt2") {
      const char* pattern = hf_pattern(v.pre);
      json byte_level = {{"type", "ByteLevel"},
                         {"add_prefix_space", false},
                         {"trim_offsets", false},
                         {"use_regex", pattern == nullptr}};
      const bool digits_apart = v.pre == "smollm" || v.pre == "command-r";
      if (pattern)
        t["pre_tokenizer"] = {{"type", "Sequence"},
                              {"pretokenizers",
                               {{{"type", "Split"},
                                 {"pattern", {{"Regex", pattern}}},
                                 {"behavior", "Isolated"},
                                 {"invert", false}},
                                byte_level}}};
      else if (digits_apart)
        t["pre_tokenizer"] = {
            {"type", "Sequence"},
            {"pretokenizers", {{{"type", "Digits"}, {"individual_digits", true}}, byte_level}}};
      else
        t["pre_tokenizer"] = byte_level;
      t["decoder"] = {{"type", "ByteLevel"},
                      {"add_prefix_space", false},
                      {"trim_offsets", false},
                      {"use_regex", true}};
      model["merges"] = v.merges;
      model["byte_fallback"] = false;
    } else {
      json normalizers = json::array();
      if (v.add_space_prefix) normalizers.push_back({{"type", "Prepend"}, {"prepend", "\u2581"}});
      normalizers.push_back(
          {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\u2581"}});
      t["normalizer"] = {{"type", "Sequence"}, {"normalizers", normalizers}};
      t["pre_tokenizer"] = nullptr;
      t["decoder"] = {
          {"type", "Sequence"},
          {"decoders",
           {{{"type", "Replace"}, {"pattern", {{"String", "\u2581"}}}, {"content", " "}},
            {{"type", "ByteFallback"}},
            {{"type", "Fuse"}}}}};
      model["merges"] = merges_of(v);
      model["byte_fallback"] = true;
      model["unk_token"] = token(v.unk);
    }
    t["model"] = model;
    write_file_atomic((dir / "tokenizer.json").string(), t.dump() + "\n");
  }
  write_file_atomic((dir / "tokenizer_config.json").string(), tconfig.dump(2) + "\n");
}

}  // namespace cputrain
