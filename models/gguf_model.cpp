#include "models/gguf_model.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <functional>
#include <set>
#include <stdexcept>
#include <tuple>

#include "engine/core/error.h"
#include "engine/train/parameters.h"
#include "models/architecture.h"
#include "models/decoder.h"
#include "models/file_hyperparameters.h"
#include "models/lora.h"
#include "models/tensor_names.h"

namespace cputrain {
namespace {

// The keys "<arch>.<key>" llama.cpp reads for the architectures of models/architecture.h, all of
// which cputrain reads; a key of the architecture not listed is refused, not passed over.
constexpr const char* kGgufKeys[] = {"vocab_size",
                                     "embedding_length",
                                     "block_count",
                                     "attention.head_count",
                                     "attention.head_count_kv",
                                     "attention.key_length",
                                     "attention.value_length",
                                     "feed_forward_length",
                                     "context_length",
                                     "rope.dimension_count",
                                     "attention.layer_norm_rms_epsilon",
                                     "rope.freq_base",
                                     "rope.scaling.type"};

constexpr double kYarnBetaFast = 32.0, kYarnBetaSlow = 1.0;

// Keys whose value in the file changes nothing: a mixture of experts with none, a scaling of 1,
// notes of the context a scaled model was trained at.
bool inert_key(const std::string& key, const GgufValue& value) {
  if (key == "expert_count" || key == "expert_used_count") return value.number == 0.0;
  if (key == "rope.scaling.factor" || key == "rope.scaling.attn_factor") return value.number == 1.0;
  // YaRN's bounds where they are llama.cpp's, which it takes whatever a file says.
  if (key == "rope.scaling.yarn_beta_fast") return value.number == kYarnBetaFast;
  if (key == "rope.scaling.yarn_beta_slow") return value.number == kYarnBetaSlow;
  return key == "rope.scaling.original_context_length" || key == "rope.scaling.finetuned";
}

std::string number_text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

// Qwen3.5's Gated DeltaNet layers (attention.recurrent_layers, else all but every
// full_attention_interval-th) and their heads (the ssm.* keys), for a model of the file's
// blocks less its multi-token-prediction ones (nextn_predict_layers, which the model leaves out).
void read_linear_attention(const GgufFile& file, const std::string& p, const Architecture& arch,
                           FileHyperparameters& hp, ModelConfig& c) {
  const auto count = [&](const std::string& key, bool required, int64_t fallback) {
    if (!file.find(p + key)) {
      if (required) throw UserError(file.path() + ": no metadata " + p + key);
      return fallback;
    }
    const int64_t v = file.integer(p + key);
    if (v <= 0 || v > kMaxLinearCount)
      throw UserError(file.path() + ": " + p + key + " " + std::to_string(v) +
                      " must be positive and at most " + std::to_string(kMaxLinearCount));
    return v;
  };
  if (!hp.n_layers.value) throw UserError(file.path() + ": no metadata " + hp.n_layers.key);
  const int64_t blocks = *hp.n_layers.value;
  const int64_t extra =
      file.find(p + "nextn_predict_layers") ? file.integer(p + "nextn_predict_layers") : 0;
  if (extra < 0 || (extra > 0 && extra >= blocks))
    throw UserError(file.path() + ": " + p + "nextn_predict_layers " + std::to_string(extra) +
                    " must be at least 0 and below " + hp.n_layers.key + " " +
                    std::to_string(blocks));
  hp.n_layers.value = blocks - extra;
  hp.extra_blocks = extra;
  const int64_t layers = blocks - extra;
  c.linear_layers.clear();
  if (const GgufValue* r = file.find(p + "attention.recurrent_layers")) {
    if (static_cast<int64_t>(r->numbers.size()) != blocks)
      throw UserError(file.path() + ": " + p + "attention.recurrent_layers has " +
                      std::to_string(r->numbers.size()) + " values for " + std::to_string(blocks) +
                      " blocks");
    for (int64_t i = 0; i < blocks; ++i) {
      if (r->numbers[static_cast<size_t>(i)] == 0.0) continue;
      if (i >= layers)
        throw UserError(file.path() + ": " + p + "attention.recurrent_layers marks block " +
                        std::to_string(i) + ", of multi-token prediction, Gated DeltaNet");
      c.linear_layers.push_back(i);
    }
  } else {
    c.linear_layers = linear_layers_between(
        count("full_attention_interval", false, arch.linear_attention_step), layers);
  }
  c.linear_conv = count("ssm.conv_kernel", true, 0);
  c.linear_key_dim = count("ssm.state_size", true, 0);
  c.linear_key_heads = count("ssm.group_count", true, 0);
  c.linear_value_heads = count("ssm.time_step_rank", true, 0);
  const int64_t inner = count("ssm.inner_size", true, 0);
  if (inner != c.linear_value_heads * c.linear_key_dim)
    throw UserError(file.path() + ": " + p + "ssm.inner_size " + std::to_string(inner) +
                    " differs from ssm.time_step_rank " + std::to_string(c.linear_value_heads) +
                    " value heads of ssm.state_size " + std::to_string(c.linear_key_dim));
  c.linear_value_dim = c.linear_key_dim;
  if (c.linear_value_heads % c.linear_key_heads != 0)
    throw UserError(file.path() + ": " + p + "ssm.time_step_rank " +
                    std::to_string(c.linear_value_heads) + " value heads are not a multiple of " +
                    p + "ssm.group_count " + std::to_string(c.linear_key_heads));
  c.attn_output_gate = arch.attn_output_gate;
}

// M-RoPE's sections (rope.dimension_sections): text gives the first three the token's position
// and the fourth 0, so RoPE rotates as plain RoPE where the sections give every rotated pair one
// of the first three (llama.cpp's interleaved M-RoPE: pair i's sector i % their sum is the
// first's where a multiple of 3 below 3 x its count, and so on).
void check_rope_sections(const GgufFile& file, const std::string& p, const ModelConfig& c) {
  const GgufValue* v = file.find(p + "rope.dimension_sections");
  if (!v) throw UserError(file.path() + ": no metadata " + p + "rope.dimension_sections");
  const std::vector<double>& s = v->numbers;
  double sum = 0.0;
  for (const double x : s) sum += x;
  const int64_t pairs = c.rope_dims() / 2;
  if (s.size() != 4 || std::any_of(s.begin(), s.end(), [](double x) { return x < 0.0; }) ||
      !(sum > 0.0) || sum > static_cast<double>(c.rope_dims()))
    throw UserError(file.path() + ": " + p +
                    "rope.dimension_sections must be four counts, their sum positive and at most "
                    "rope.dimension_count " +
                    std::to_string(c.rope_dims()));
  for (int64_t i = 0; i < pairs; ++i) {
    const auto sector = static_cast<int64_t>(std::fmod(static_cast<double>(i), sum));
    const int64_t which = sector % 3;
    if (sector >= 3 * static_cast<int64_t>(s[static_cast<size_t>(which)]))
      throw UserError(file.path() + ": " + p + "rope.dimension_sections leave RoPE pair " +
                      std::to_string(i) +
                      " of text unrotated, which cputrain does not compute (it rotates every "
                      "pair of rope.dimension_count)");
  }
}

}  // namespace

std::string gguf_supported_architectures() {
  return architecture_names();
}

// A per-layer key (head_count_kv, feed_forward_length) of `layers` values: one for all, or an
// array of one a layer; empty where the file does not give it.
std::vector<int64_t> per_layer_values(const GgufFile& file, const std::string& key,
                                      int64_t layers) {
  const GgufValue* v = file.find(key);
  if (!v) return {};
  if (v->type != GgufType::Array)
    return std::vector<int64_t>(static_cast<size_t>(layers), file.integer(key));
  const std::vector<double>& values = file.numbers(key);
  if (static_cast<int64_t>(values.size()) != layers)
    throw UserError(file.path() + ": metadata " + key + " has " + std::to_string(values.size()) +
                    " values for " + std::to_string(layers) + " layers");
  std::vector<int64_t> out;
  for (const double x : values) {
    if (!(x >= 1.0) || x != std::floor(x) || x > static_cast<double>(kMaxLinearCount))
      throw UserError(file.path() + ": metadata " + key + " holds " + number_text(x) +
                      ", not a positive count");
    out.push_back(static_cast<int64_t>(x));
  }
  return out;
}

// The sliding-window pattern of attention.sliding_window_pattern: a number (every pattern-th
// layer global), or an array of a flag a layer (Gemma 4's) whose windowed layers must be those
// of some pattern.
int64_t window_pattern(const GgufFile& file, const std::string& key, int64_t fallback,
                       int64_t layers) {
  const GgufValue* v = file.find(key);
  if (!v || v->type != GgufType::Array) return file.integer(key, fallback);
  const std::vector<double>& flags = file.numbers(key);
  if (static_cast<int64_t>(flags.size()) != layers)
    throw UserError(file.path() + ": metadata " + key + " has " + std::to_string(flags.size()) +
                    " values for " + std::to_string(layers) + " layers");
  int64_t pattern = 1;
  while (pattern <= layers && flags[static_cast<size_t>(pattern - 1)] != 0.0) ++pattern;
  for (int64_t i = 0; i < layers; ++i)
    if ((flags[static_cast<size_t>(i)] != 0.0) != (i % pattern < pattern - 1))
      throw UserError(file.path() + ": metadata " + key +
                      " windows layers in no repeating pattern of windowed layers then one "
                      "global, which cputrain does not compute (layer " +
                      std::to_string(i) + ")");
  return pattern;
}

// Gemma 4's layers of two shapes: the windowed layers' head size, key/value heads and rotated
// dimensions (the first layer's, which hp's keys check against its tensors) and the global
// layers' (`layer_shapes` sets them once the first layer is read); the MLP's width per layer;
// the layers sharing keys and values; the per-layer embeddings' width.
void read_layer_shapes(const GgufFile& file, const std::string& p, const Architecture& arch,
                       FileHyperparameters& hp, ModelConfig& c) {
  if (!hp.n_layers.value) throw UserError(file.path() + ": no metadata " + hp.n_layers.key);
  const int64_t layers = *hp.n_layers.value;
  if (layers <= 0 || layers > kMaxLinearCount)
    throw UserError(file.path() + ": metadata " + hp.n_layers.key + " " + std::to_string(layers) +
                    " must be a positive count");
  c.sliding_window = file.integer(p + "attention.sliding_window", arch.default_window);
  if (c.sliding_window < 0)
    throw UserError(file.path() + ": " + p + "attention.sliding_window must be positive");
  c.swa_pattern =
      c.sliding_window > 0
          ? window_pattern(file, p + "attention.sliding_window_pattern", arch.swa_pattern, layers)
          : 0;
  if (c.swa_pattern == 1) c.sliding_window = c.swa_pattern = 0;
  const bool first_windowed = c.windowed_layer(0);
  // The first global layer's value and the first windowed layer's of a per-layer key, checked
  // the same in every layer of its kind.
  const auto kinds =
      [&](const std::string& key) -> std::pair<std::optional<int64_t>, std::optional<int64_t>> {
    const std::vector<int64_t> v = per_layer_values(file, key, layers);
    if (v.empty()) return {};
    std::optional<int64_t> global, windowed;
    for (int64_t i = 0; i < layers; ++i) {
      std::optional<int64_t>& kind = c.windowed_layer(i) ? windowed : global;
      if (!kind) kind = v[static_cast<size_t>(i)];
      if (*kind != v[static_cast<size_t>(i)])
        throw UserError(file.path() + ": metadata " + key +
                        " differs between layers of one kind (windowed or global), which "
                        "cputrain does not compute (layer " +
                        std::to_string(i) + ")");
    }
    return {global, windowed};
  };
  const auto [kv_global, kv_windowed] = kinds(p + "attention.head_count_kv");
  const auto optional_integer = [&](const std::string& key) {
    return file.find(key) ? std::optional<int64_t>(file.integer(key)) : std::nullopt;
  };
  const std::optional<int64_t> head_global = optional_integer(p + "attention.key_length");
  const std::optional<int64_t> head_windowed = optional_integer(p + "attention.key_length_swa");
  const std::optional<int64_t> rope_global = optional_integer(p + "rope.dimension_count");
  const std::optional<int64_t> rope_windowed = optional_integer(p + "rope.dimension_count_swa");
  for (const auto& [key, head] : {std::pair{"attention.value_length_swa", head_windowed},
                                  std::pair{"attention.value_length", head_global}})
    if (file.find(p + key) && head && file.integer(p + key) != *head)
      throw UserError(file.path() + ": " + p + key +
                      " differs from its key length, which "
                      "cputrain does not compute");
  // The first layer's, which the file's tensors are checked against first.
  if (first_windowed) {
    hp.n_kv_heads = {p + "attention.head_count_kv", kv_windowed};
    if (head_windowed) hp.head_dim = {p + "attention.key_length_swa", head_windowed};
    hp.rope_dim = {p + "rope.dimension_count_swa", rope_windowed ? rope_windowed : head_windowed};
  } else {
    hp.n_kv_heads = {p + "attention.head_count_kv", kv_global};
    hp.rope_dim = {p + "rope.dimension_count", rope_global};
  }
  std::vector<int64_t> widths = per_layer_values(file, p + "feed_forward_length", layers);
  hp.ffn = {p + "feed_forward_length",
            widths.empty() ? std::nullopt : std::optional<int64_t>(widths[0])};
  c.shared_kv_layers = file.integer(p + "attention.shared_kv_layers", 0);
  c.per_layer_dim = file.integer(p + "embedding_length_per_layer_input", 0);
  for (const auto& [key, v] : {std::pair{"attention.shared_kv_layers", c.shared_kv_layers},
                               std::pair{"embedding_length_per_layer_input", c.per_layer_dim}})
    if (v < 0 || v > kMaxLinearCount)
      throw UserError(file.path() + ": metadata " + p + key + " " + std::to_string(v) +
                      " is not a count cputrain reads");
  // The layers whose file gives no attn_v (Gemma 4 31B's global layers take k as v).
  std::vector<bool> no_v(static_cast<size_t>(layers));
  for (int64_t i = 0; i < layers; ++i)
    no_v[static_cast<size_t>(i)] =
        arch.k_as_v && !file.tensor("blk." + std::to_string(i) + ".attn_v.weight");
  hp.layer_shapes = [=, where = file.path()](ModelConfig& m) {
    for (int64_t i = 0; i < m.n_layers && i < layers; ++i)
      if (no_v[static_cast<size_t>(i)] && !m.windowed_layer(i) && m.kv_layer(i) == i)
        m.k_as_v = true;
    if (!first_windowed) return;
    // The first layer's are the windowed layers'; the global layers' as the file gives them.
    m.head_dim_swa = m.head_size();
    m.n_kv_heads_swa = m.kv_heads();
    m.rope_dim_swa = m.rope_dim > 0 ? m.rope_dim : m.head_dim_swa;
    if (head_global) m.head_dim = *head_global;
    if (kv_global) m.n_kv_heads = *kv_global;
    m.rope_dim = rope_global ? *rope_global : 0;
    if (m.head_dim <= 0 || m.head_dim > kMaxLinearCount || m.n_kv_heads <= 0 ||
        m.n_kv_heads > m.n_heads || m.rope_dim < 0 || m.rope_dim > m.head_size())
      throw UserError(where +
                      ": the global layers' head size, key/value heads or rotated "
                      "dimensions (" +
                      p +
                      "attention.key_length, head_count_kv, "
                      "rope.dimension_count) do not fit together");
    if (m.rope_dim == m.head_size()) m.rope_dim = 0;
    if (m.rope_dim_swa == m.head_dim_swa) m.rope_dim_swa = 0;
    if (m.head_dim_swa == m.head_size()) m.head_dim_swa = 0;
    if (m.n_kv_heads_swa == m.kv_heads()) m.n_kv_heads_swa = 0;
    if (std::adjacent_find(widths.begin(), widths.end(), std::not_equal_to<>()) != widths.end())
      m.layer_ffn = widths;
  };
}

ModelConfig gguf_model_config(const GgufFile& file, int64_t max_ctx) {
  const std::string name = file.string("general.architecture");
  const Architecture* arch = find_architecture(name);
  if (!arch)
    throw UserError(file.path() + ": architecture " + name +
                    ", which cputrain does not compute (it computes " +
                    gguf_supported_architectures() + ")");
  if (!arch->gguf_written) require_files(*arch, file.path());
  const std::string p = name + ".";
  for (const auto& [key, value] : file.metadata()) {
    if (!key.starts_with(p)) continue;
    const std::string rest = key.substr(p.size());
    if (std::find_if(std::begin(kGgufKeys), std::end(kGgufKeys),
                     [&](const char* k) { return rest == k; }) == std::end(kGgufKeys) &&
        std::find(arch->gguf_keys.begin(), arch->gguf_keys.end(), rest) == arch->gguf_keys.end() &&
        !inert_key(rest, value))
      throw UserError(file.path() + ": metadata " + key + ", which cputrain does not read for " +
                      name + " (nothing in a model file is passed over)");
  }
  const auto given = [&](const std::string& key) {
    return FileHyperparameter{
        key, file.find(key) ? std::optional<int64_t>(file.integer(key)) : std::nullopt};
  };
  ModelConfig c;
  c.architecture = name;
  FileHyperparameters hp;
  hp.where = file.path();
  hp.naming = TensorNaming::Gguf;
  hp.vocab = given(p + "vocab_size");
  hp.d_model = given(p + "embedding_length");
  hp.n_layers = given(p + "block_count");
  hp.n_heads = given(p + "attention.head_count");
  // Per-layer values where the layers differ in shape (read_layer_shapes).
  if (!arch->layer_shapes) {
    hp.n_kv_heads = given(p + "attention.head_count_kv");
    hp.head_dim = given(p + "attention.key_length");
    hp.ffn = given(p + (arch->moe ? "expert_feed_forward_length" : "feed_forward_length"));
  } else {
    hp.head_dim = given(p + "attention.key_length");
    read_layer_shapes(file, p, *arch, hp, c);
  }
  if (arch->moe) {
    hp.n_experts = given(p + "expert_count");
    hp.experts_used = given(p + "expert_used_count");
    hp.shared_expert_ffn = given(p + "expert_shared_feed_forward_length");
    for (const FileHyperparameter* required : {&hp.n_experts, &hp.experts_used})
      if (!required->value) throw UserError(file.path() + ": no metadata " + required->key);
    if (arch->shared_expert && !hp.shared_expert_ffn.value)
      throw UserError(file.path() + ": no metadata " + hp.shared_expert_ffn.key);
  } else if (arch->experts_beside_mlp && file.integer(p + "expert_count", 0) != 0) {
    // Experts beside the dense MLP (Gemma 4 26B-A4B), their gate and up in one tensor as its
    // converter writes them, or apart.
    hp.n_experts = given(p + "expert_count");
    hp.experts_used = given(p + "expert_used_count");
    hp.expert_ffn = given(p + "expert_feed_forward_length");
    for (const FileHyperparameter* required : {&hp.experts_used, &hp.expert_ffn})
      if (!required->value) throw UserError(file.path() + ": no metadata " + required->key);
    c.experts_gate_up_fused =
        file.tensor("blk.0.ffn_gate_up_exps.weight") && !file.tensor("blk.0.ffn_gate_exps.weight");
  }
  hp.ctx = given(p + "context_length");
  if (!arch->layer_shapes) hp.rope_dim = given(p + "rope.dimension_count");
  for (const FileHyperparameter* required :
       {&hp.d_model, &hp.n_layers, &hp.n_heads, &hp.ffn, &hp.ctx})
    if (!required->value) throw UserError(file.path() + ": no metadata " + required->key);
  // A number the file gives where zero computes nothing (a soft-cap divides by it, a RoPE base
  // of 0 rotates by infinities): refused unless positive and finite, as given.
  const auto positive = [&](const std::string& key, double fallback) {
    const double v = file.number(key, fallback);
    if (file.find(key) && (!(v > 0.0) || !std::isfinite(v)))
      throw UserError(file.path() + ": " + key + " " + number_text(v) + " must be positive");
    return v;
  };
  // llama.cpp's type without the key is linear: a factor scales the positions whatever the type
  // says, so "none" beside a factor other than 1 is refused, not guessed.
  const std::string scaling = file.string(p + "rope.scaling.type", "linear");
  const double factor = file.number(p + "rope.scaling.factor", 1.0);
  if (scaling == "none" && factor != 1.0)
    throw UserError(file.path() + ": " + p + "rope.scaling.factor " + number_text(factor) +
                    " beside rope.scaling.type none");
  const bool yarn = scaling == "yarn" &&
                    std::find(arch->rope_scalings.begin(), arch->rope_scalings.end(), "yarn") !=
                        arch->rope_scalings.end();
  if (scaling != "none" && scaling != "linear" && !yarn)
    throw UserError(file.path() + ": " + p + "rope.scaling.type " + scaling +
                    ", which cputrain does not compute for " + name + " (it computes " +
                    rope_scaling_names(*arch) + ")");
  c.norm_eps = static_cast<float>(
      file.number(p + (arch->norm == Norm::LayerNorm ? "attention.layer_norm_epsilon"
                                                     : "attention.layer_norm_rms_epsilon"),
                  1e-5));
  c.rope_theta = file.number(p + "rope.freq_base", 10000.0);  // validate()'s: above 1
  c.rope_pairs = arch->gguf_rope_pairs;
  c.tie_embeddings = arch->always_tied || file.tensor("output.weight") == nullptr;
  // q, k and v in one tensor where the family's own are apart: llama.cpp reads either form of
  // any family with plain attention (Phi-2's files converted from its original checkpoint).
  c.qkv_fused = !arch->fused_qkv && arch->linear_attention_step == 0 && !arch->attn_output_gate &&
                file.tensor("blk.0.attn_qkv.weight") && !file.tensor("blk.0.attn_q.weight");
  c.qkv_bias = arch->qkv_bias == Presence::Always ||
               (arch->qkv_bias == Presence::Optional &&
                file.tensor(c.qkv_fused ? "blk.0.attn_qkv.bias" : "blk.0.attn_q.bias") != nullptr);
  c.qk_norm = arch->qk_norm;
  if (arch->linear_attention_step > 0) read_linear_attention(file, p, *arch, hp, c);
  std::vector<std::string> names;
  names.reserve(file.tensors().size());
  for (const GgufTensor& t : file.tensors()) names.push_back(t.name);
  check_file_hyperparameters(
      hp, names,
      [&](const std::string& tensor) -> std::optional<std::vector<int64_t>> {
        const GgufTensor* t = file.tensor(tensor);
        if (!t) return std::nullopt;
        return std::vector<int64_t>(t->dims.rbegin(), t->dims.rend());
      },
      c);
  c.head_dim = c.head_size();
  if (file.integer(p + "attention.value_length", c.head_dim) != c.head_dim)
    throw UserError(file.path() + ": " + p +
                    "attention.value_length differs from key_length, "
                    "which cputrain does not compute");
  c.no_rope_layers = step_no_rope_layers(*arch, c.n_layers);
  if (arch->linear_attention_step > 0) check_rope_sections(file, p, c);
  // RoPE scaling as factors of each frequency: rope_freqs (Llama 3.1/3.2's), or Phi-3's longrope
  // short and long ones.
  const auto factors = [&](const char* tensor, const char* type) -> std::vector<float> {
    const GgufTensor* t = file.tensor(tensor);
    if (!t) return {};
    const auto applies = [&](std::string_view t) {
      return std::find(arch->rope_scalings.begin(), arch->rope_scalings.end(), t) !=
             arch->rope_scalings.end();
    };
    // Factors of no known scaling (Gemma 4's proportional RoPE) where the architecture reads
    // them so.
    if (!applies(type) && !(std::string_view(type) == "llama3" && applies("factors")))
      throw UserError(file.path() + ": tensor " + tensor + ", RoPE scaling (" + type +
                      ") which cputrain does not compute for " + name + " (it computes " +
                      rope_scaling_names(*arch) + ")");
    if (t->dims != std::vector<int64_t>{c.rope_dims() / 2})
      throw UserError(file.path() + ": tensor " + tensor + " has shape " + shape_text(t->dims) +
                      " where the rotated dimensions give [" + std::to_string(c.rope_dims() / 2) +
                      "]");
    check_tensor_type(file, *t);
    return gguf_tensor_values(file, *t);
  };
  if (std::vector<float> f = factors("rope_freqs.weight", "llama3"); !f.empty())
    c.rope_scaling = rope_scaling_of_factors(std::move(f), c);
  std::vector<float> long_factors = factors("rope_factors_long.weight", "longrope");
  std::vector<float> short_factors = factors("rope_factors_short.weight", "longrope");
  if (!long_factors.empty() || !short_factors.empty()) {
    if (long_factors.empty() || short_factors.empty())
      throw UserError(file.path() + ": " +
                      (long_factors.empty() ? "rope_factors_short.weight without "
                                              "rope_factors_long.weight"
                                            : "rope_factors_long.weight without "
                                              "rope_factors_short.weight"));
    c.rope_scaling.type = "longrope";
    c.rope_scaling.freq_factors = std::move(short_factors);
    c.rope_scaling.long_factors = std::move(long_factors);
    c.rope_scaling.attn_factor = file.number(p + "rope.scaling.attn_factor", 1.0);
    c.rope_scaling.original_ctx = file.integer(p + "rope.scaling.original_context_length", c.ctx);
  }
  // Linear scaling (llama.cpp's default type) by rope.scaling.factor, read where the
  // architecture applies it (a factor other than 1 elsewhere is a key cputrain does not read).
  if (scaling == "linear" && factor != 1.0 &&
      std::find(arch->rope_scalings.begin(), arch->rope_scalings.end(), "linear") !=
          arch->rope_scalings.end()) {
    if (!(factor > 0.0) || !std::isfinite(factor))
      throw UserError(file.path() + ": " + p + "rope.scaling.factor " + std::to_string(factor) +
                      " must be a positive number");
    if (c.rope_scaling.active())
      throw UserError(file.path() + ": linear RoPE scaling beside " + c.rope_scaling.type +
                      " scaling");
    c.rope_scaling = linear_rope_scaling(factor, c.rope_dims());
  }
  if (yarn) {
    // YaRN (gpt-oss) from the factor and the original context (the file's context where it
    // gives none), on every layer; cos and sin also scaled by rope.scaling.attn_factor.
    if (!(factor >= 1.0) || !std::isfinite(factor))
      throw UserError(file.path() + ": " + p + "rope.scaling.factor " + number_text(factor) +
                      " must be at least 1 for yarn scaling");
    const int64_t original =
        file.integer(p + "rope.scaling.original_context_length", *hp.ctx.value);
    if (original <= 0)
      throw UserError(file.path() + ": " + p + "rope.scaling.original_context_length " +
                      std::to_string(original) + " must be positive");
    c.rope_scaling = yarn_rope_scaling(c.rope_theta, c.rope_dims(), factor, original, kYarnBetaFast,
                                       kYarnBetaSlow);
    c.rope_scaling.attn_factor *= positive(p + "rope.scaling.attn_factor", 1.0);
  }
  const int64_t window = file.integer(p + "attention.sliding_window", arch->default_window);
  if (file.find(p + "attention.sliding_window") && window <= 0)
    throw UserError(file.path() + ": " + p + "attention.sliding_window " + std::to_string(window) +
                    " must be positive");
  if (arch->swa_pattern > 0 && window > 0) {
    // Sliding-window layers (Gemma 2, 3): every pattern-th global, the others within the window
    // at their own RoPE base (llama.cpp's defaults: Gemma 3's 10,000, Gemma 2's the model's).
    c.sliding_window = window;
    c.swa_pattern =
        window_pattern(file, p + "attention.sliding_window_pattern", arch->swa_pattern, c.n_layers);
    if (c.swa_pattern <= 0)
      throw UserError(file.path() + ": " + p + "attention.sliding_window_pattern " +
                      std::to_string(c.swa_pattern) + " must be positive");
    c.rope_theta_swa =
        positive(p + "rope.freq_base_swa",
                 arch->default_rope_theta_swa > 0.0 ? arch->default_rope_theta_swa : c.rope_theta);
  } else if (window > 0) {
    // Phi-3's sliding window, which llama.cpp passes over: the context within it, where both
    // compute the same.
    c.ctx = std::min(c.ctx, window);
  }
  // Gemma 2 and 3 27B's scores are scaled by d_model / heads, not the head dimension, as llama.cpp
  // knows them by their layer count (Hugging Face's query_pre_attn_scalar).
  if (arch->width_scaled_layers > 0 && c.n_layers == arch->width_scaled_layers)
    c.attn_scale = 1.0f / std::sqrt(static_cast<float>(c.d_model / c.n_heads));
  if (arch->attn_softcap)
    c.attn_softcap =
        static_cast<float>(positive(p + "attn_logit_softcapping", arch->default_attn_softcap));
  if (arch->swa_pattern > 0)
    c.final_softcap =
        static_cast<float>(positive(p + "final_logit_softcapping", arch->default_final_softcap));
  c.ctx = std::min(c.ctx, max_ctx);
  if (const auto problem = validate(c))
    throw UserError(file.path() +
                    ": the model's hyperparameters do not fit together: " + problem->str());
  return c;
}

namespace {

// The file's tensor holding parameter `info` (of a DecoderModel of `config`), of its shape (its
// parts' together, for a fused tensor) and of a type cputrain converts; a UserError naming the
// file and tensor otherwise. `part` receives where in it the parameter's rows are.
const GgufTensor& gguf_tensor_of(const GgufFile& file, const ParameterInfo& info,
                                 const ModelConfig& config, TensorPart* part = nullptr) {
  const TensorPart where = tensor_part(info, config, TensorNaming::Gguf);
  const std::string& name = where.name;
  const GgufTensor* t = file.tensor(name);
  if (!t) throw UserError(file.path() + ": no tensor " + name + " (the model's " + info.name + ")");
  const std::vector<int64_t> shape = file_tensor_shape(info, where, TensorNaming::Gguf);
  std::vector<int64_t> expected(shape.rbegin(), shape.rend());
  // A matrix of one row may be held as a vector (file_hyperparameters.cpp).
  if (expected.size() == 2 && expected[1] == 1 && t->dims.size() == 1) expected.pop_back();
  if (t->dims != expected)
    throw UserError(file.path() + ": tensor " + name + " has shape " + shape_text(t->dims) +
                    " where the model's hyperparameters give " + shape_text(expected));
  check_tensor_type(file, *t);
  if (part) *part = where;
  return *t;
}

// The block of tensor `name` ("blk.12.attn_q.weight": 12); -1 where it is no block's.
int64_t gguf_block_of(const std::string& name) {
  if (!name.starts_with("blk.")) return -1;
  int64_t block = 0;
  size_t i = 4;
  for (; i < name.size() && i < 12 && std::isdigit(static_cast<unsigned char>(name[i])); ++i)
    block = block * 10 + (name[i] - '0');
  return i > 4 && i < name.size() && name[i] == '.' ? block : -1;
}

// Every tensor of the file is one of `used`'s (a tied model's may hold the head as well, a copy
// of the embedding); a UserError naming the first that is not.
void check_no_other_tensors(const GgufFile& file, const std::set<std::string>& used,
                            const ModelConfig& config) {
  for (const GgufTensor& t : file.tensors()) {
    // RoPE factors are read into the configuration (gguf_model_config); the blocks after the
    // model's are its multi-token-prediction ones, left out (gguf_left_out).
    if (used.count(t.name) || t.name == "output.weight" || t.name == "rope_freqs.weight" ||
        t.name == "rope_factors_long.weight" || t.name == "rope_factors_short.weight" ||
        gguf_block_of(t.name) >= config.n_layers)
      continue;
    throw UserError(file.path() + ": tensor " + t.name + " has no place in the " +
                    file.string("general.architecture") + " model cputrain computes");
  }
}

}  // namespace

std::string gguf_left_out(const GgufFile& file, const ModelConfig& config) {
  int64_t last = -1;
  for (const GgufTensor& t : file.tensors()) last = std::max(last, gguf_block_of(t.name));
  if (last < config.n_layers) return "";
  const std::string first = "blk." + std::to_string(config.n_layers);
  return " (" + (last == config.n_layers ? first : first + "-" + std::to_string(last)) +
         ", multi-token prediction, left out)";
}

void check_gguf_weights(const GgufFile& file, const ModelConfig& config) {
  ParameterSet declared;
  DecoderModel::declare_parameters(config, declared);
  std::set<std::string> used;
  for (const ParameterInfo& info : declared.infos())
    used.insert(gguf_tensor_of(file, info, config).name);
  check_no_other_tensors(file, used, config);
}

namespace {

// The dtype a GGUF tensor of `type` is held as in place; F32 where it cannot be.
DType in_place_dtype(uint32_t type) {
  if (type == static_cast<uint32_t>(GgmlType::BF16)) return DType::BF16;
  if (!ggml_type_supported(type)) return DType::F32;
  const auto q = ggml_quant_type(static_cast<GgmlType>(type));
  return q ? quantized_dtype(*q) : DType::F32;
}

}  // namespace

void load_gguf_weights(const GgufFile& file, const ParameterSet& params,
                       const ModelConfig& config) {
  std::set<std::string> used;
  // A fused tensor's parts follow one another: it is converted once for them all.
  const GgufTensor* converted = nullptr;
  std::vector<float> values;
  for (size_t i = 0; i < params.infos().size(); ++i) {
    const ParameterInfo& info = params.infos()[i];
    if (is_lora_parameter(info.name)) continue;  // adapters are not the file's
    TensorPart part;
    const GgufTensor* t = &gguf_tensor_of(file, info, config, &part);
    const std::string& name = t->name;
    const int64_t row = info.shape.numel() / info.shape[0];
    // A BF16 tensor into a parameter held as bf16 alone is read in place or copied as it is; a
    // quantised one held so, read in place.
    if (params.mapped(static_cast<int>(i))) {
      if (in_place_dtype(t->type) != info.mapped_dtype)
        throw std::logic_error("load_gguf_weights: " + name + " mapped as another type");
    } else if (t->type == static_cast<uint32_t>(GgmlType::BF16) &&
               params.bf16_only(static_cast<int>(i)) && !interleaved_part(info, config) &&
               !part.per_expert) {
      params.write_bf16_values(static_cast<int>(i), t->data.data() + part.first_row * row * 2);
    } else {
      if (converted != t) values = gguf_tensor_values(file, *t);
      converted = t;
      std::vector<float> mine = part_values(values, info, part, config);
      // Gated DeltaNet's A: the file's ssm_a is -A, the model holds log A.
      if (info.name.ends_with(".linear.a_log.weight"))
        for (float& v : mine) {
          if (!(v < 0.0f) || !std::isfinite(v))
            throw UserError(file.path() + ": tensor " + name + " holds " + number_text(v) +
                            ", where -A (A = exp(A_log)) is negative");
          v = std::log(-v);
        }
      params.write_values(static_cast<int>(i), mine.data());
    }
    used.insert(name);
  }
  check_no_other_tensors(file, used, config);
}

InPlaceWeight gguf_in_place(const GgufFile& file, const ParameterInfo& parameter,
                            const ModelConfig& config) {
  const TensorPart part = tensor_part(parameter, config, TensorNaming::Gguf);
  const GgufTensor* t = file.tensor(part.name);
  if (!t || interleaved_part(parameter, config)) return {};
  const DType dtype = in_place_dtype(t->type);
  if (dtype == DType::F32) return {};
  if (parameter.shape.ndim() == 3) {
    // A mixture's experts (E, rows, cols), one tensor whole.
    const std::vector<int64_t> whole{parameter.shape[2], parameter.shape[1], parameter.shape[0]};
    if (part.first_row != 0 || t->dims != whole || t->data.size() != dtype_bytes(dtype, t->numel()))
      return {};
    return {t->data.data(), dtype};
  }
  if (parameter.shape.ndim() != 2) return {};
  const std::vector<int64_t> dims{parameter.shape[1], part.tensor_rows};
  const int64_t row = parameter.shape[1];
  if (t->dims != dims || t->data.size() != dtype_bytes(dtype, t->numel())) return {};
  return {t->data.data() + dtype_bytes(dtype, part.first_row * row), dtype};
}

namespace {

// llama.cpp's general.file_type for the matrices' type.
uint32_t file_type(GgmlType type) {
  switch (type) {
    case GgmlType::F16:
      return 1;
    case GgmlType::Q8_0:
      return 7;
    case GgmlType::BF16:
      return 32;
    case GgmlType::Q4_K:
      return 15;  // Q4_K_M
    default:
      return 0;
  }
}

// Of Q4_K_M's mix, llama.cpp's rule for it: the head (the embedding where it is tied) Q6_K; the
// value projections and the MLP's down projections (a mixture's experts' and shared expert's
// too) of the first and last eighth of the layers and of every third between them Q6_K; the
// other matrices Q4_K. Of a mixture of 8 experts the key and value
// projections are Q8_0 (llama.cpp's attention output of one, Q5_K, is Q4_K here: cputrain does
// not write Q5_K). A matrix whose rows are not whole blocks of 256 is, as llama.cpp writes it,
// Q5_0 for Q4_K and Q8_0 for Q6_K (F16 where they are not whole blocks of 32).
GgmlType q4_k_m_type(const std::string& name, const std::vector<int64_t>& shape, bool tied,
                     int64_t layers, int64_t experts) {
  int64_t layer = -1;
  if (name.starts_with("blk.")) layer = std::stoll(name.substr(4));
  const bool more_bits = layer >= 0 && (layer < layers / 8 || layer >= 7 * layers / 8 ||
                                        (layer - layers / 8) % 3 == 2);
  const bool v = name.ends_with(".attn_v.weight") || name.ends_with(".attn_qkv.weight");
  const int64_t row = shape.back();
  if (experts == 8 && (v || name.ends_with(".attn_k.weight")))
    return row % 32 == 0 ? GgmlType::Q8_0 : GgmlType::F16;
  const bool six = name == "output.weight" || (tied && name == "token_embd.weight") ||
                   (more_bits && (v || name.find(".ffn_down") != std::string::npos));
  if (row % 256 == 0) return six ? GgmlType::Q6_K : GgmlType::Q4_K;
  if (row % 32 == 0) return six ? GgmlType::Q8_0 : GgmlType::Q5_0;
  return GgmlType::F16;
}

}  // namespace

namespace {

// llama.cpp scales each expert's down product by ffn_down_exps.scale before it adds the
// adapter's (Gemma 4's), where the model scales the adapted product: an adapter's B of the
// experts' down product (E, C, r) is written times each expert's scale and read divided by it.
void scale_down_adapter(std::vector<float>& b, const ParameterInfo& info,
                        const ParameterSet& params, bool divide, const std::string& path) {
  const std::string adapter = "feed_forward.experts.w2.lora_b";
  if (!info.name.ends_with(adapter)) return;
  const int scale = params.find(info.name.substr(0, info.name.size() - adapter.size()) +
                                "feed_forward.expert_scale.weight");
  if (scale < 0) return;
  const int64_t E = info.shape[0], block = info.shape.numel() / E;
  std::vector<float> s(static_cast<size_t>(E));
  params.read_values(scale, s.data());
  for (int64_t e = 0; e < E; ++e) {
    const float f = s[static_cast<size_t>(e)];
    if (divide && !(f != 0.0f))
      throw UserError(path + ": expert " + std::to_string(e) + " of " + info.name +
                      " has an output scale of 0, through which its adapter cannot be read");
    for (int64_t i = 0; i < block; ++i) {
      float& v = b[static_cast<size_t>(e * block + i)];
      v = divide ? v / f : v * f;
    }
  }
}

}  // namespace

void write_lora_gguf(const std::string& path, const ModelConfig& c, const ParameterSet& params,
                     double alpha, const std::string& name) {
  const Architecture& arch = architecture_of(c);
  if (!arch.gguf_written) require_files(arch, path);
  GgufWriter w;
  w.set_string("general.architecture", std::string(arch.name));
  w.set_string("general.type", "adapter");
  if (!name.empty()) w.set_string("general.name", name);
  w.set_string("adapter.type", "lora");
  w.set_f32("adapter.lora.alpha", static_cast<float>(alpha));
  w.set_string("cputrain.base_fingerprint", fingerprint_text(base_fingerprint(c, params)));
  const std::vector<FileTensor> tensors =
      file_tensors(params, c, TensorNaming::Gguf,
                   [](const ParameterInfo& info) { return is_lora_parameter(info.name); });
  for (const FileTensor& t : tensors) {
    std::vector<float> values = file_tensor_values(params, t, c, arch.gguf_rope_pairs, false);
    if (t.parts.size() == 1)
      scale_down_adapter(values, params.infos()[static_cast<size_t>(t.parts[0])], params, false,
                         path);
    // ggml's dimensions, innermost first: a mixture's experts' A (E, r, in) is [in, r, E].
    w.add_tensor(
        t.name, std::vector<int64_t>(t.shape.rbegin(), t.shape.rend()), GgmlType::F32,
        ggml_from_float(GgmlType::F32, values.data(), static_cast<int64_t>(values.size())));
  }
  if (tensors.empty()) throw std::logic_error("write_lora_gguf: a model without adapters");
  w.write(path);
}

LoraConfig lora_gguf_config(const GgufFile& file) {
  if (file.string("general.type", "") != "adapter" || file.string("adapter.type", "") != "lora")
    throw UserError(file.path() + ": not a LoRA adapter (general.type " +
                    file.string("general.type", "model") + ")");
  LoraConfig lora;
  lora.alpha = file.number("adapter.lora.alpha", 0.0);
  // Each tensor name's projections: a fused tensor's are its parts'.
  const Architecture* arch = find_architecture(file.string("general.architecture", ""));
  const bool fused_gate_up = arch && arch->fused_gate_up;
  // q, k and v in one (attn_qkv): Phi-3's attention, Qwen3.5's Gated DeltaNet layers, any
  // family's base file that holds them so.
  const bool linear = arch && arch->linear_attention_step > 0;
  using P = Projection;
  const std::vector<P> none;
  const std::pair<const char*, std::vector<P>> gguf_names[] = {
      {"attn_q", {P::Q}},
      {"attn_k", {P::K}},
      {"attn_v", {P::V}},
      {"attn_qkv", {P::Q, P::K, P::V}},
      {"attn_output", {P::O}},
      {"ffn_gate", {P::Gate}},
      {"ffn_up", fused_gate_up ? std::vector<P>{P::Gate, P::Up} : std::vector<P>{P::Up}},
      {"ffn_down", {P::Down}},
      // A mixture's experts (an adapter each, in one tensor), shared expert and router.
      {"ffn_gate_exps", {P::Gate}},
      {"ffn_up_exps", {P::Up}},
      {"ffn_down_exps", {P::Down}},
      {"ffn_gate_up_exps", {P::Gate, P::Up}},
      {"ffn_gate_shexp", {P::Gate}},
      {"ffn_up_shexp", {P::Up}},
      {"ffn_down_shexp", {P::Down}},
      {"ffn_gate_inp", {P::Router}},
      {"ssm_out", linear ? std::vector<P>{P::O} : none},
      {"attn_gate", linear ? std::vector<P>{P::Z} : none},
      {"ssm_beta", linear ? std::vector<P>{P::Beta} : none},
      {"ssm_alpha", linear ? std::vector<P>{P::Alpha} : none}};
  for (const GgufTensor& t : file.tensors()) {
    if (!t.name.ends_with(".weight.lora_a") && !t.name.ends_with(".weight.lora_b"))
      throw UserError(file.path() + ": tensor " + t.name + " is not a LoRA adapter's");
    bool known = false;
    for (const auto& [gguf_name, projections] : gguf_names) {
      if (t.name.find(std::string(".") + gguf_name + ".weight.lora_") == std::string::npos)
        continue;
      for (const P p : projections) lora.targets[static_cast<size_t>(p)] = true;
      known = !projections.empty();
    }
    if (!known)
      throw UserError(file.path() + ": tensor " + t.name +
                      " adapts a projection cputrain does not compute");
    if (t.name.ends_with(".lora_a") && (t.dims.size() == 2 || t.dims.size() == 3)) {
      if (lora.rank != 0 && lora.rank != t.dims[1])
        throw UserError(file.path() + ": adapters of more than one rank");
      lora.rank = t.dims[1];
    }
  }
  if (lora.rank <= 0) throw UserError(file.path() + ": no adapter tensors");
  if (!(lora.alpha > 0.0)) lora.alpha = static_cast<double>(lora.rank);  // llama.cpp's default
  return lora;
}

void load_lora_gguf(const GgufFile& file, const ModelConfig& c, const ParameterSet& params) {
  const Architecture& arch = architecture_of(c);
  const std::string of = file.string("general.architecture", "");
  if (of != arch.name)
    throw UserError(file.path() + ": an adapter for a " + of + " model, not this " +
                    std::string(arch.name) + " one");
  // Shapes first, then the base's fingerprint, then the values.
  std::vector<std::tuple<size_t, const GgufTensor*, TensorPart>> adapters;
  std::set<std::string> used;
  for (size_t i = 0; i < params.infos().size(); ++i) {
    const ParameterInfo& info = params.infos()[i];
    if (!is_lora_parameter(info.name)) continue;
    const TensorPart part = tensor_part(info, c, TensorNaming::Gguf);
    const GgufTensor* t = file.tensor(part.name);
    if (!t) throw UserError(file.path() + ": no tensor " + part.name);
    const std::vector<int64_t> shape = file_tensor_shape(info, part, TensorNaming::Gguf);
    const std::vector<int64_t> expected(shape.rbegin(), shape.rend());
    if (t->dims != expected)
      throw UserError(file.path() + ": tensor " + part.name + " has shape " + shape_text(t->dims) +
                      " where this model takes " + shape_text(expected));
    adapters.emplace_back(i, t, part);
    used.insert(part.name);
  }
  if (used.size() != file.tensors().size())
    throw UserError(file.path() + ": " + std::to_string(file.tensors().size()) +
                    " tensors, of which this model takes " + std::to_string(used.size()));
  const std::string want = fingerprint_text(base_fingerprint(c, params));
  const std::string got = file.string("cputrain.base_fingerprint", want);
  if (got != want)
    throw UserError(file.path() + ": an adapter trained on another base model (fingerprint " + got +
                    ", this model's " + want + ")");
  const GgufTensor* converted = nullptr;
  std::vector<float> all;  // a fused B converted once for its parts
  for (const auto& [i, t, part] : adapters) {
    const ParameterInfo& info = params.infos()[i];
    if (converted != t) all = gguf_tensor_values(file, *t);
    converted = t;
    std::vector<float> values = part_values(all, info, part, c);
    reorder_qk_rows(values, info, c, arch.gguf_rope_pairs, c.rope_pairs);
    scale_down_adapter(values, info, params, true, file.path());
    params.write_values(static_cast<int>(i), values.data());
  }
}

GgmlType write_gguf(const std::string& path, const ModelConfig& c, const ParameterSet& params,
                    const Vocabulary& v, const GgufExport& options) {
  const Architecture& description = architecture_of(c);
  if (!description.gguf_written) require_files(description, path);
  const std::string arch(description.name);
  if (description.linear_attention_step > 0) {
    // llama.cpp's qwen35: heads of one width for keys and values, and its pattern of layers.
    if (c.linear_key_dim != c.linear_value_dim ||
        c.linear_layers != step_linear_layers(description, c.n_layers))
      throw UserError(path + ": llama.cpp's " + arch +
                      " holds Gated DeltaNet heads of one width for keys and values, in every "
                      "layer but each " +
                      std::to_string(description.linear_attention_step) +
                      "th; this model's are not");
  }
  if (c.no_rope_layers != step_no_rope_layers(description, c.n_layers))
    throw UserError("a " + arch + " model whose layers without RoPE are not llama.cpp's (every " +
                    std::to_string(description.no_rope_layer_step) +
                    "th): GGUF has no key for them");
  GgmlType matrices = options.type;
  if (matrices == GgmlType::Q8_0) {
    for (const ParameterInfo& info : params.infos())
      if (info.shape.ndim() >= 2 && info.shape[info.shape.ndim() - 1] % 32 != 0 &&
          !is_lora_parameter(info.name))
        matrices = GgmlType::F16;
  }
  GgufWriter w;
  w.set_string("general.architecture", arch);
  if (!options.name.empty()) w.set_string("general.name", options.name);
  w.set_u32("general.file_type", file_type(matrices));
  w.set_u32(arch + ".context_length", static_cast<uint32_t>(c.ctx));
  w.set_u32(arch + ".embedding_length", static_cast<uint32_t>(c.d_model));
  w.set_u32(arch + ".block_count", static_cast<uint32_t>(c.n_layers));
  w.set_u32(arch + ".feed_forward_length", static_cast<uint32_t>(c.ffn));
  w.set_u32(arch + ".attention.head_count", static_cast<uint32_t>(c.n_heads));
  w.set_u32(arch + ".attention.head_count_kv", static_cast<uint32_t>(c.kv_heads()));
  w.set_u32(arch + ".attention.key_length", static_cast<uint32_t>(c.head_size()));
  w.set_u32(arch + ".attention.value_length", static_cast<uint32_t>(c.head_size()));
  w.set_f32(arch + (description.norm == Norm::LayerNorm ? ".attention.layer_norm_epsilon"
                                                        : ".attention.layer_norm_rms_epsilon"),
            c.norm_eps);
  w.set_f32(arch + ".rope.freq_base", static_cast<float>(c.rope_theta));
  w.set_u32(arch + ".rope.dimension_count", static_cast<uint32_t>(c.rope_dims()));
  w.set_u32(arch + ".vocab_size", static_cast<uint32_t>(c.vocab));
  if (c.sliding_window > 0) {
    w.set_u32(arch + ".attention.sliding_window", static_cast<uint32_t>(c.sliding_window));
    w.set_u32(arch + ".attention.sliding_window_pattern", static_cast<uint32_t>(c.swa_pattern));
    w.set_f32(arch + ".rope.freq_base_swa",
              static_cast<float>(c.rope_theta_swa > 0.0 ? c.rope_theta_swa : c.rope_theta));
  }
  if (description.layer_shapes) {
    // Gemma 4's: values per layer where they differ, the windowed layers' head size and
    // rotation apart, the window pattern a flag a layer.
    std::vector<int32_t> kv_heads, widths;
    GgufValue windowed;
    windowed.type = GgufType::Array;
    windowed.element = GgufType::Bool;
    for (int64_t l = 0; l < c.n_layers; ++l) {
      kv_heads.push_back(static_cast<int32_t>(c.kv_heads(l)));
      widths.push_back(static_cast<int32_t>(c.ffn_width(l)));
      windowed.numbers.push_back(c.windowed_layer(l) ? 1.0 : 0.0);
    }
    w.set_i32s(arch + ".attention.head_count_kv", kv_heads);
    if (!c.layer_ffn.empty()) w.set_i32s(arch + ".feed_forward_length", widths);
    if (c.sliding_window > 0) {
      w.set_value(arch + ".attention.sliding_window_pattern", std::move(windowed));
      w.set_u32(arch + ".attention.key_length_swa", static_cast<uint32_t>(c.head_size_swa()));
      w.set_u32(arch + ".attention.value_length_swa", static_cast<uint32_t>(c.head_size_swa()));
      w.set_u32(arch + ".rope.dimension_count_swa", static_cast<uint32_t>(c.rope_dims_swa()));
    }
    w.set_u32(arch + ".attention.shared_kv_layers", static_cast<uint32_t>(c.shared_kv_layers));
    w.set_u32(arch + ".embedding_length_per_layer_input", static_cast<uint32_t>(c.per_layer_dim));
  }
  if (!c.linear_layers.empty()) {
    w.set_u32(arch + ".ssm.conv_kernel", static_cast<uint32_t>(c.linear_conv));
    w.set_u32(arch + ".ssm.inner_size", static_cast<uint32_t>(c.linear_v_dim()));
    w.set_u32(arch + ".ssm.state_size", static_cast<uint32_t>(c.linear_key_dim));
    w.set_u32(arch + ".ssm.time_step_rank", static_cast<uint32_t>(c.linear_value_heads));
    w.set_u32(arch + ".ssm.group_count", static_cast<uint32_t>(c.linear_key_heads));
    w.set_u32(arch + ".full_attention_interval",
              static_cast<uint32_t>(description.linear_attention_step));
    const std::array<int64_t, 3> s = text_mrope_sections(c.rope_dims() / 2);
    w.set_i32s(
        arch + ".rope.dimension_sections",
        {static_cast<int32_t>(s[0]), static_cast<int32_t>(s[1]), static_cast<int32_t>(s[2]), 0});
  }
  if (c.moe()) {
    w.set_u32(arch + ".expert_count", static_cast<uint32_t>(c.n_experts));
    w.set_u32(arch + ".expert_used_count", static_cast<uint32_t>(c.experts_used));
    w.set_u32(arch + ".expert_feed_forward_length", static_cast<uint32_t>(c.expert_width()));
    if (c.shared_expert_ffn > 0)
      w.set_u32(arch + ".expert_shared_feed_forward_length",
                static_cast<uint32_t>(c.shared_expert_ffn));
  }
  if (description.attn_softcap) w.set_f32(arch + ".attn_logit_softcapping", c.attn_softcap);
  if (description.swa_pattern > 0 &&
      (c.final_softcap > 0.0f || description.default_final_softcap > 0.0f))
    w.set_f32(arch + ".final_logit_softcapping", c.final_softcap);
  set_gguf_vocabulary(w, v);
  const int64_t pairs = c.rope_dims() / 2;
  const auto factors = [&](const char* name, const std::vector<float>& f) {
    w.add_tensor(name, {pairs}, GgmlType::F32, ggml_from_float(GgmlType::F32, f.data(), pairs));
  };
  if (c.rope_scaling.type == "longrope") {
    w.set_f32(arch + ".rope.scaling.attn_factor", static_cast<float>(c.rope_scaling.attn_factor));
    w.set_u32(arch + ".rope.scaling.original_context_length",
              static_cast<uint32_t>(c.rope_scaling.original_ctx));
    factors("rope_factors_long.weight", c.rope_scaling.long_factors);
    factors("rope_factors_short.weight", c.rope_scaling.freq_factors);
  } else if (c.rope_scaling.type == "linear") {
    w.set_string(arch + ".rope.scaling.type", "linear");
    w.set_f32(arch + ".rope.scaling.factor", static_cast<float>(c.rope_scaling.factor));
  } else if (c.rope_scaling.type == "yarn") {
    // llama.cpp computes YaRN from these alone: beta 32 and 1, its dimensions rounded (a
    // Hugging Face config's other betas or truncate false are not in the file, as its converter
    // writes none), cos and sin scaled by 1 + 0.1 ln factor times rope.scaling.attn_factor.
    w.set_string(arch + ".rope.scaling.type", "yarn");
    w.set_f32(arch + ".rope.scaling.factor", static_cast<float>(c.rope_scaling.factor));
    w.set_u32(arch + ".rope.scaling.original_context_length",
              static_cast<uint32_t>(c.rope_scaling.original_ctx));
    const double attn = c.rope_scaling.attn_factor / yarn_attn_factor(c.rope_scaling.factor);
    if (attn != 1.0) w.set_f32(arch + ".rope.scaling.attn_factor", static_cast<float>(attn));
  } else if (c.rope_scaling.active()) {
    factors("rope_freqs.weight", c.rope_scaling.freq_factors);
  }
  if (!options.read)
    for (const ParameterInfo& info : params.infos())
      if (is_lora_parameter(info.name))
        throw std::logic_error("write_gguf: a model with adapters (merge them first)");
  const std::vector<FileTensor> tensors =
      file_tensors(params, c, TensorNaming::Gguf,
                   [](const ParameterInfo& info) { return !is_lora_parameter(info.name); });
  const bool tied = std::none_of(tensors.begin(), tensors.end(),
                                 [](const FileTensor& t) { return t.name == "output.weight"; });
  for (const FileTensor& t : tensors) {
    const std::vector<int64_t> dims(t.shape.rbegin(), t.shape.rend());
    // The convolution's taps, biases (a mixture's experts' are 2-D) and a mixture's routers
    // (ffn_gate_inp, ffn_gate_inp_shexp) stay F32, as llama.cpp's converter and quantiser keep
    // them; a mixture's experts (E, rows, cols) are matrices.
    const GgmlType type =
        (t.shape.size() != 2 && t.shape.size() != 3) || !t.name.ends_with(".weight") ||
                t.name.ends_with(".ssm_conv1d.weight") ||
                t.name.find(".ffn_gate_inp") != std::string::npos
            ? GgmlType::F32
        : matrices == GgmlType::Q4_K ? q4_k_m_type(t.name, t.shape, tied, c.n_layers, c.n_experts)
                                     : matrices;
    w.add_tensor(t.name, dims, type, [&, t, type] {
      // q and k rows in the pairing llama.cpp applies to the architecture; norm gains whole.
      std::vector<float> values =
          file_tensor_values(params, t, c, description.gguf_rope_pairs, false, false, options.read);
      // Gated DeltaNet's A, held as log A: llama.cpp's ssm_a is -A.
      if (t.name.ends_with(".ssm_a"))
        for (float& v : values) v = -std::exp(v);
      return ggml_from_float(type, values.data(), static_cast<int64_t>(values.size()));
    });
  }
  w.write(path);
  return matrices;
}

}  // namespace cputrain
