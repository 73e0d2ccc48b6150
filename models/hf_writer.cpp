#include "models/hf_writer.h"

#include <spdlog/fmt/fmt.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "engine/core/error.h"
#include "engine/io/atomic_file.h"
#include "engine/io/gguf_file.h"
#include "engine/text/tokenizer.h"
#include "engine/text/vocab_tokenizer.h"
#include "engine/train/parameters.h"
#include "models/architecture.h"
#include "models/decoder.h"
#include "models/file_hyperparameters.h"
#include "models/hf_json.h"
#include "models/lora.h"
#include "models/tensor_names.h"

namespace cputrain {

namespace fs = std::filesystem;
using nlohmann::json;

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

// Tensors of a safetensors file read together (one of the model's, or a gpt-oss layer's six
// expert tensors) and the entries made of them: `entry(values, i)` gives entry i's bytes from the
// parts' values, in the file's order.
struct SafetensorsGroup {
  std::vector<FileTensor> parts;
  std::vector<std::pair<std::string, Shape>> entries;
  std::function<std::vector<uint8_t>(const std::vector<std::vector<float>>&, size_t)> entry;
};

Shape shape_of(const std::vector<int64_t>& dims) {
  return dims.size() == 1   ? Shape{dims[0]}
         : dims.size() == 2 ? Shape{dims[0], dims[1]}
                            : Shape{dims[0], dims[1], dims[2]};
}

// Tensor t as `type`: itself, or a mixture's experts (E, rows, cols) and their adapters one entry
// each, as Hugging Face and PEFT hold them (mlp.experts.<e>.gate_proj).
SafetensorsGroup tensor_group(const FileTensor& t, GgmlType type) {
  SafetensorsGroup g;
  g.parts = {t};
  if (t.shape.size() == 3 && t.name.find(".experts.") != std::string::npos) {
    const size_t at = t.name.find(".experts.") + 9;
    const int64_t n = t.shape[1] * t.shape[2];
    for (int64_t e = 0; e < t.shape[0]; ++e)
      g.entries.emplace_back(t.name.substr(0, at) + std::to_string(e) + "." + t.name.substr(at),
                             Shape{t.shape[1], t.shape[2]});
    g.entry = [type, n](const std::vector<std::vector<float>>& v, size_t e) {
      return ggml_from_float(type, v[0].data() + static_cast<int64_t>(e) * n, n);
    };
    return g;
  }
  g.entries.emplace_back(t.name, shape_of(t.shape));
  g.entry = [type](const std::vector<std::vector<float>>& v, size_t) {
    return ggml_from_float(type, v[0].data(), static_cast<int64_t>(v[0].size()));
  };
  return g;
}

// gpt-oss's experts of one layer (`base` "model.layers.N.mlp.experts."), from the model's gate,
// up and down weights and biases by their rest of name ("gate_proj.weight"): gate_up_proj
// [E, C, 2 F] (each expert's gate and up columns alternating), gate_up_proj_bias [E, 2 F],
// down_proj [E, F, C], down_proj_bias [E, C].
SafetensorsGroup gpt_oss_experts_group(const std::string& base,
                                       const std::map<std::string, FileTensor>& parts,
                                       GgmlType type) {
  constexpr const char* kParts[] = {"gate_proj.weight", "up_proj.weight",   "gate_proj.bias",
                                    "up_proj.bias",     "down_proj.weight", "down_proj.bias"};
  SafetensorsGroup g;
  for (const char* rest : kParts) {
    const auto it = parts.find(rest);
    if (it == parts.end()) throw std::logic_error("gpt-oss experts without " + base + rest);
    g.parts.push_back(it->second);
  }
  const int64_t E = g.parts[0].shape[0], F = g.parts[0].shape[1], C = g.parts[0].shape[2];
  g.entries = {{base + "gate_up_proj", Shape{E, C, 2 * F}},
               {base + "gate_up_proj_bias", Shape{E, 2 * F}},
               {base + "down_proj", Shape{E, F, C}},
               {base + "down_proj_bias", Shape{E, C}}};
  g.entry = [type, E, F, C](const std::vector<std::vector<float>>& v, size_t i) {
    const auto at = [](int64_t j) { return static_cast<size_t>(j); };
    std::vector<float> out;
    if (i == 0) {  // gate_up_proj: x times it, gate and up columns alternating
      out.resize(at(E * C * 2 * F));
      for (int64_t e = 0; e < E; ++e)
        for (int64_t f = 0; f < F; ++f)
          for (int64_t col = 0; col < C; ++col) {
            const size_t from = at((e * F + f) * C + col);
            out[at((e * C + col) * 2 * F + 2 * f)] = v[0][from];
            out[at((e * C + col) * 2 * F + 2 * f + 1)] = v[1][from];
          }
    } else if (i == 1) {
      out.resize(at(E * 2 * F));
      for (int64_t j = 0; j < E * F; ++j) {
        out[at(2 * j)] = v[2][at(j)];
        out[at(2 * j + 1)] = v[3][at(j)];
      }
    } else if (i == 2) {  // down_proj [E, F, C]: the model's (E, C, F) transposed
      out.resize(at(E * F * C));
      for (int64_t e = 0; e < E; ++e)
        for (int64_t f = 0; f < F; ++f)
          for (int64_t col = 0; col < C; ++col)
            out[at((e * F + f) * C + col)] = v[4][at((e * C + col) * F + f)];
    } else {
      return ggml_from_float(type, v[5].data(), static_cast<int64_t>(v[5].size()));
    }
    return ggml_from_float(type, out.data(), static_cast<int64_t>(out.size()));
  };
  return g;
}

// Gemma 4's experts of one layer (`base` "model.layers.N.experts."), from the model's gate, up
// and down weights by their rest of name (the gate and up in one, where the model holds them
// so): gate_up_proj [E, 2 F, C] (each expert's gate rows, then its up rows) and down_proj
// [E, C, F], as Transformers holds them.
SafetensorsGroup gemma4_experts_group(const std::string& base,
                                      const std::map<std::string, FileTensor>& parts,
                                      GgmlType type) {
  SafetensorsGroup g;
  if (parts.contains("gate_up_proj.weight")) {
    for (const char* rest : {"gate_up_proj.weight", "down_proj.weight"}) {
      const auto it = parts.find(rest);
      if (it == parts.end()) throw std::logic_error("Gemma 4 experts without " + base + rest);
      g.parts.push_back(it->second);
      g.entries.emplace_back(base + std::string(rest).substr(0, std::string(rest).size() - 7),
                             shape_of(it->second.shape));
    }
    g.entry = [type](const std::vector<std::vector<float>>& v, size_t i) {
      return ggml_from_float(type, v[i].data(), static_cast<int64_t>(v[i].size()));
    };
    return g;
  }
  for (const char* rest : {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}) {
    const auto it = parts.find(rest);
    if (it == parts.end()) throw std::logic_error("Gemma 4 experts without " + base + rest);
    g.parts.push_back(it->second);
  }
  const int64_t E = g.parts[0].shape[0], F = g.parts[0].shape[1], C = g.parts[0].shape[2];
  g.entries = {{base + "gate_up_proj", Shape{E, 2 * F, C}}, {base + "down_proj", Shape{E, C, F}}};
  g.entry = [type, E, F, C](const std::vector<std::vector<float>>& v, size_t i) {
    if (i == 1) return ggml_from_float(type, v[2].data(), static_cast<int64_t>(v[2].size()));
    std::vector<float> out(static_cast<size_t>(E * 2 * F * C));
    const int64_t n = F * C;
    for (int64_t e = 0; e < E; ++e)
      for (int64_t half = 0; half < 2; ++half)
        std::copy_n(v[static_cast<size_t>(half)].begin() + e * n, n,
                    out.begin() + (2 * e + half) * n);
    return ggml_from_float(type, out.data(), static_cast<int64_t>(out.size()));
  };
  return g;
}

// Gemma 4's config.json keys in `config` (gemma4_text's): layer_types, the windowed layers' head
// size and key/value heads and the global layers' own, RoPE by the layers' kind (the global
// layers' proportional: their frequency factors of 1 and then 1e30), the layers sharing keys and
// values and their double-wide MLPs, the per-layer embeddings' width, the experts beside the MLP.
// A UserError for what Transformers' Gemma4 does not express.
void gemma4_config(const ModelConfig& c, json& config) {
  const auto refuse = [](const std::string& what) {
    throw UserError("a gemma4 model " + what +
                    ", which Hugging Face's Gemma4 config does not express (export it as GGUF)");
  };
  json types = json::array();
  for (int64_t i = 0; i < c.n_layers; ++i)
    types.push_back(c.windowed_layer(i) ? "sliding_attention" : "full_attention");
  const int64_t kv_windowed = c.n_kv_heads_swa > 0 ? c.n_kv_heads_swa : c.kv_heads();
  if (!c.k_as_v && kv_windowed != c.kv_heads())
    refuse("whose global layers have key/value heads of their own without taking k as v");
  // Proportional RoPE on the global layers: the first pairs rotate as a full head's, the others
  // (a factor of 1e30) do not.
  const int64_t head = c.head_size(), pairs = head / 2;
  int64_t rotated = pairs;
  if (c.rope_scaling.active()) {
    const std::vector<float>& f = c.rope_scaling.freq_factors;
    rotated = 0;
    while (rotated < static_cast<int64_t>(f.size()) && f[static_cast<size_t>(rotated)] == 1.0f)
      ++rotated;
    const bool proportional =
        c.rope_scaling.type == "factors" && static_cast<int64_t>(f.size()) == pairs &&
        std::all_of(f.begin() + rotated, f.end(), [](float x) { return x >= 1e29f; });
    if (!proportional) refuse("with RoPE scaling other than proportional RoPE");
  }
  if (c.rope_dim > 0 || c.rope_dim_swa > 0) refuse("rotating part of each head without factors");
  if (!c.layer_ffn.empty()) {
    bool doubled = c.shared_kv_layers > 0;
    for (int64_t i = 0; i < c.n_layers; ++i)
      doubled = doubled && c.layer_ffn[static_cast<size_t>(i)] ==
                               (i < c.n_layers - c.shared_kv_layers ? c.ffn : 2 * c.ffn);
    if (!doubled) refuse("whose MLP widths are not those of use_double_wide_mlp");
  }
  for (const char* key : {"rope_theta", "rope_scaling", "partial_rotary_factor", "hidden_act",
                          "query_pre_attn_scalar", "attn_logit_softcapping",
                          "sliding_window_pattern", "rope_local_base_freq", "num_experts_per_tok",
                          "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"})
    config.erase(key);
  config["architectures"] = {"Gemma4ForCausalLM"};
  config["model_type"] = "gemma4_text";
  config["layer_types"] = types;
  config["head_dim"] = c.head_size_swa();
  config["global_head_dim"] = head;
  config["num_key_value_heads"] = kv_windowed;
  config["num_global_key_value_heads"] = c.k_as_v ? json(c.kv_heads()) : json();
  config["attention_k_eq_v"] = c.k_as_v;
  config["sliding_window"] = c.sliding_window > 0 ? json(c.sliding_window) : json();
  config["rope_parameters"] = {
      {"full_attention",
       {{"rope_type", "proportional"},
        {"rope_theta", c.rope_theta},
        {"partial_rotary_factor", static_cast<double>(2 * rotated) / static_cast<double>(head)}}},
      {"sliding_attention", {{"rope_type", "default"}, {"rope_theta", c.rope_swa_theta()}}}};
  config["num_kv_shared_layers"] = c.shared_kv_layers;
  config["use_double_wide_mlp"] = !c.layer_ffn.empty();
  config["hidden_size_per_layer_input"] = c.per_layer_dim;
  config["vocab_size_per_layer_input"] = c.vocab;
  config["enable_moe_block"] = c.experts_beside_mlp();
  config["num_experts"] = c.experts_beside_mlp() ? json(c.n_experts) : json();
  config["top_k_experts"] = c.experts_beside_mlp() ? json(c.experts_used) : json();
  config["moe_intermediate_size"] = c.experts_beside_mlp() ? json(c.expert_ffn) : json();
  config["use_bidirectional_attention"] = nullptr;
}

// A safetensors file of the groups' entries, in order, written atomically: the header from their
// shapes, then group by group their parts' values (`values`) and each entry's bytes, so that one
// group's values are held at a time.
void write_safetensors(const std::string& path, const std::vector<SafetensorsGroup>& groups,
                       GgmlType type,
                       const std::function<std::vector<float>(const FileTensor&)>& values) {
  json header = json::object();
  uint64_t offset = 0;
  for (const SafetensorsGroup& g : groups)
    for (const auto& [name, shape] : g.entries) {
      std::vector<int64_t> dims;
      for (int d = 0; d < shape.ndim(); ++d) dims.push_back(shape[d]);
      const uint64_t bytes = ggml_bytes(type, shape.numel());
      header[name] = {{"dtype", ggml_type_name(static_cast<uint32_t>(type))},
                      {"shape", dims},
                      {"data_offsets", {offset, offset + bytes}}};
      offset += bytes;
    }
  header["__metadata__"] = {{"format", "pt"}};
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  AtomicFileWriter out(path);
  const uint64_t n = text.size();
  out.write(&n, 8);
  out.write(text.data(), text.size());
  for (const SafetensorsGroup& g : groups) {
    std::vector<std::vector<float>> parts;
    for (const FileTensor& t : g.parts) parts.push_back(values(t));
    for (size_t i = 0; i < g.entries.size(); ++i) {
      const std::vector<uint8_t> bytes = g.entry(parts, i);
      if (bytes.size() != ggml_bytes(type, g.entries[i].second.numel()))
        throw std::logic_error("safetensors entry " + g.entries[i].first + ": its size");
      out.write(bytes.data(), bytes.size());
    }
  }
  out.commit();
}

}  // namespace

void write_peft_adapter(const std::string& folder, const ModelConfig& c, const ParameterSet& params,
                        const LoraConfig& lora, const std::string& base) {
  // PEFT's names are the Hugging Face modules': a mixture's experts' adapters one each
  // (mlp.experts.<e>.gate_proj), its router's mlp.gate.
  require_files(architecture_of(c), folder);
  const fs::path dir(folder);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw UserError(folder + ": cannot create (" + ec.message() + ")");
  std::vector<SafetensorsGroup> groups;
  const bool shared_qkv_a = c.qkv_fused && !architecture_of(c).fused_qkv;
  for (const FileTensor& t :
       file_tensors(params, c, TensorNaming::HuggingFace,
                    [](const ParameterInfo& info) { return is_lora_parameter(info.name); })) {
    groups.push_back(tensor_group(t, GgmlType::F32));
    // A model read from a GGUF file with q, k and v in one tensor shares one A among them
    // (ModelConfig::qkv_fused): PEFT's q_proj, k_proj and v_proj each hold it.
    constexpr std::string_view kFused = ".qkv_proj.";
    const size_t at = t.name.find(kFused);
    if (shared_qkv_a && at != std::string::npos) {
      SafetensorsGroup& g = groups.back();
      g.entries.clear();
      for (const char* p : {".q_proj.", ".k_proj.", ".v_proj."})
        g.entries.emplace_back(t.name.substr(0, at) + p + t.name.substr(at + kFused.size()),
                               shape_of(t.shape));
    }
  }
  if (groups.empty()) throw std::logic_error("write_peft_adapter: a model without adapters");
  // B's q and k rows in Hugging Face's rotate-half order, as its projections' rows are; a fused
  // projection's parts' B rows one after another.
  write_safetensors((dir / "adapter_model.safetensors").string(), groups, GgmlType::F32,
                    [&](const FileTensor& t) {
                      return file_tensor_values(params, t, c, RopePairs::HalfSplit, false, true);
                    });
  // The modules, by the architecture's names (Phi-3's fused qkv_proj and gate_up_proj, Phi-2's
  // dense, fc1, fc2, Qwen3.5's in_proj_qkv and out_proj beside its attention's q_proj...): the
  // last part of each adapted tensor's name, in the order the blocks first have them.
  json targets = json::array();
  for (const FileTensor& t :
       file_tensors(params, c, TensorNaming::HuggingFace,
                    [](const ParameterInfo& info) { return info.name.ends_with(".lora_b"); })) {
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
                     const Tokenizer& tokenizer, const std::string& dtype,
                     const ValueReader& read) {
  require_files(architecture_of(c), folder);
  const fs::path dir(folder);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw UserError("--out " + folder + ": cannot create (" + ec.message() + ")");
  const Architecture& arch = architecture_of(c);
  if (c.qkv_bias && arch.qkv_bias != Presence::Always)
    throw UserError("a " + std::string(arch.name) + " model with q/k/v biases: Hugging Face's " +
                    std::string(arch.hf_class) +
                    " has none (train it with --arch qwen2, or export it as GGUF)");
  if (c.rope_scaling.type == "factors" && !arch.layer_shapes)
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
  } else if (c.rope_scaling.type == "yarn") {
    config["rope_scaling"] = {{"rope_type", "yarn"},
                              {"factor", c.rope_scaling.factor},
                              {"beta_fast", c.rope_scaling.beta_fast},
                              {"beta_slow", c.rope_scaling.beta_slow},
                              {"truncate", c.rope_scaling.truncate},
                              {"attention_factor", c.rope_scaling.attn_factor},
                              {"original_max_position_embeddings", c.rope_scaling.original_ctx}};
  } else if (c.rope_scaling.active())
    config["rope_scaling"] = {{"rope_type", c.rope_scaling.type},
                              {"factor", c.rope_scaling.factor},
                              {"low_freq_factor", c.rope_scaling.low_freq_factor},
                              {"high_freq_factor", c.rope_scaling.high_freq_factor},
                              {"original_max_position_embeddings", c.rope_scaling.original_ctx}};
  if (arch.linear_attention_step > 0) {
    // Qwen3.5's: each layer's kind, the DeltaNet heads, RoPE among rope_parameters (M-RoPE's
    // sections over the rotated pairs, which text rotates as plain RoPE).
    json types = json::array();
    for (int64_t i = 0; i < c.n_layers; ++i)
      types.push_back(c.linear_layer(i) ? "linear_attention" : "full_attention");
    config.erase("rope_theta");
    config.erase("rope_scaling");
    config.erase("partial_rotary_factor");
    config.erase("use_sliding_window");
    config.update({{"layer_types", types},
                   {"full_attention_interval", arch.linear_attention_step},
                   {"linear_conv_kernel_dim", c.linear_conv},
                   {"linear_key_head_dim", c.linear_key_dim},
                   {"linear_value_head_dim", c.linear_value_dim},
                   {"linear_num_key_heads", c.linear_key_heads},
                   {"linear_num_value_heads", c.linear_value_heads},
                   {"attn_output_gate", c.attn_output_gate},
                   {"rope_parameters",
                    {{"rope_type", "default"},
                     {"rope_theta", c.rope_theta},
                     {"partial_rotary_factor",
                      static_cast<double>(c.rope_dims()) / static_cast<double>(c.head_size())},
                     {"mrope_interleaved", true},
                     {"mrope_section", text_mrope_sections(c.rope_dims() / 2)}}}});
  }
  if (c.moe() && arch.hf_gpt_oss_experts) {
    // gpt-oss's: its experts' keys, the window by layer types, q/k/v/o biases.
    json types = json::array();
    for (int64_t i = 0; i < c.n_layers; ++i)
      types.push_back(c.windowed_layer(i) ? "sliding_attention" : "full_attention");
    config.erase("query_pre_attn_scalar");
    config.erase("final_logit_softcapping");
    config.erase("attn_logit_softcapping");
    config.update({{"num_local_experts", c.n_experts},
                   {"num_experts_per_tok", c.experts_used},
                   {"intermediate_size", c.ffn},
                   {"layer_types", types},
                   {"attention_bias", true},
                   {"swiglu_limit", kernels::kSiluClampedLimit}});
  } else if (c.moe()) {
    config.update({{"num_experts", c.n_experts},
                   {"num_experts_per_tok", c.experts_used},
                   {"moe_intermediate_size", c.ffn},
                   {"norm_topk_prob", c.expert_weights_norm},
                   {"decoder_sparse_step", 1},
                   {"mlp_only_layers", json::array()}});
    if (c.shared_expert_ffn > 0) config["shared_expert_intermediate_size"] = c.shared_expert_ffn;
  }
  if (arch.no_rope_layer_step > 0) {
    json layers = json::array();
    for (int64_t i = 0; i < c.n_layers; ++i) layers.push_back(c.rope_in_layer(i) ? 1 : 0);
    config["no_rope_layers"] = layers;
  }
  if (arch.layer_shapes) gemma4_config(c, config);
  write_file_atomic((dir / "config.json").string(), config.dump(2) + "\n");

  // model.safetensors: the header, then each tensor's bytes in order.
  const GgmlType type = dtype == "F32"   ? GgmlType::F32
                        : dtype == "F16" ? GgmlType::F16
                                         : GgmlType::BF16;
  if (!read)
    for (const ParameterInfo& info : params.infos())
      if (is_lora_parameter(info.name))
        throw std::logic_error("write_hf_folder: a model with adapters (merge them first)");
  // gpt-oss's experts by layer ("model.layers.N.mlp.experts."), by our name's rest
  // ("gate_proj.weight"), written fused after the others.
  std::vector<SafetensorsGroup> groups;
  std::map<std::string, std::map<std::string, FileTensor>> experts;
  for (const FileTensor& t :
       file_tensors(params, c, TensorNaming::HuggingFace,
                    [](const ParameterInfo& info) { return !is_lora_parameter(info.name); })) {
    if (const size_t at = t.name.find(".experts.");
        (arch.hf_gpt_oss_experts || arch.experts_beside_mlp) && at != t.name.npos) {
      experts[t.name.substr(0, at + 9)][t.name.substr(at + 9)] = t;
      continue;
    }
    groups.push_back(tensor_group(t, type));
  }
  for (const auto& [base, parts] : experts)
    groups.push_back(arch.hf_gpt_oss_experts ? gpt_oss_experts_group(base, parts, type)
                                             : gemma4_experts_group(base, parts, type));
  // Each tensor's values read as it is written (Gated DeltaNet's value heads grouped by key head,
  // as Hugging Face holds them).
  write_safetensors((dir / "model.safetensors").string(), groups, type, [&](const FileTensor& t) {
    return file_tensor_values(params, t, c, RopePairs::HalfSplit, arch.hf_norm_plus_one, true,
                              read);
  });

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
      model["merges"] = v.model == "gemma4" ? v.merges : merges_of(v);
      model["byte_fallback"] = true;
      model["unk_token"] = token(v.unk);
    }
    t["model"] = model;
    write_file_atomic((dir / "tokenizer.json").string(), t.dump() + "\n");
  }
  write_file_atomic((dir / "tokenizer_config.json").string(), tconfig.dump(2) + "\n");
}

}  // namespace cputrain
