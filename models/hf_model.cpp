#include "models/hf_model.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "engine/error.h"
#include "engine/parameters.h"
#include "engine/tokenizer.h"
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

LlamaConfig hf_model_config(const std::string& folder, int64_t max_ctx) {
  const fs::path path = fs::path(folder) / "config.json";
  const json j = read_json(path);
  const std::string where = path.string();
  const std::string type = j.value("model_type", "");
  if (type != "llama" && type != "mistral" && type != "qwen2")
    throw UserError(where + ": model_type " + type +
                    ", which cputrain does not compute (it computes llama, mistral, qwen2)");
  LlamaConfig c;
  try {
    c.vocab = j.at("vocab_size").get<int64_t>();
    c.d_model = j.at("hidden_size").get<int64_t>();
    c.n_layers = j.at("num_hidden_layers").get<int64_t>();
    c.n_heads = j.at("num_attention_heads").get<int64_t>();
    c.n_kv_heads = j.value("num_key_value_heads", c.n_heads);
    c.ffn = j.at("intermediate_size").get<int64_t>();
    c.norm_eps = j.value("rms_norm_eps", 1e-6f);
    c.rope_theta = j.value("rope_theta", 10000.0);
    c.ctx = j.value("max_position_embeddings", int64_t{2048});
    if (j.contains("head_dim") && !j["head_dim"].is_null())
      c.head_dim = j["head_dim"].get<int64_t>();
    c.tie_embeddings = j.value("tie_word_embeddings", false);
    c.qkv_bias = type == "qwen2" || j.value("attention_bias", false);
    if (j.contains("sliding_window") && j["sliding_window"].is_number_integer() &&
        j.value("use_sliding_window", type == "mistral"))
      c.ctx = std::min(c.ctx, j["sliding_window"].get<int64_t>());
    if (j.contains("rope_scaling") && !j["rope_scaling"].is_null())
      throw UserError(where + ": rope_scaling " + j["rope_scaling"].dump() +
                      ", which cputrain does not compute");
    if (j.value("hidden_act", "silu") != "silu")
      throw UserError(where + ": hidden_act " + j.value("hidden_act", "") +
                      ", which cputrain does not compute (it computes silu)");
    if (j.value("mlp_bias", false))
      throw UserError(where + ": mlp_bias, which cputrain does not compute");
  } catch (const json::exception& e) {
    throw UserError(where + ": " + e.what());
  }
  c.ctx = std::min(c.ctx, max_ctx);
  c.rope_pairs = RopePairs::HalfSplit;
  if (const auto problem = validate(c))
    throw UserError(where + ": the model's hyperparameters do not fit together: " + problem->str());
  return c;
}

std::string hf_tensor_name(const std::string& parameter) {
  return tensor_name(parameter, TensorNaming::HuggingFace);
}

void load_hf_weights(const SafetensorsModel& weights, const ParameterSet& params) {
  std::set<std::string> used;
  for (size_t i = 0; i < params.infos().size(); ++i) {
    const ParameterInfo& info = params.infos()[i];
    const std::string name = hf_tensor_name(info.name);
    const SafetensorsTensor* t = weights.find(name);
    if (!t) throw UserError("the model's safetensors have no tensor " + name);
    std::vector<int64_t> expected;
    for (int d = 0; d < info.shape.ndim(); ++d) expected.push_back(info.shape[d]);
    if (t->shape != expected)
      throw UserError(weights.file_of(name) + ": tensor " + name + " has shape " +
                      shape_text(t->shape) + " where config.json gives " + shape_text(expected));
    const std::vector<float> values = safetensors_values(weights.file_of(name), name, *t);
    params.write_values(static_cast<int>(i), values.data());
    used.insert(name);
  }
  for (const std::string& name : weights.names()) {
    // A tied model's folder may hold the head as well; rotary tables are derived, not weights.
    if (used.count(name) || name == "lm_head.weight" || name.ends_with("rotary_emb.inv_freq"))
      continue;
    throw UserError(weights.file_of(name) + ": tensor " + name +
                    " has no place in the model cputrain computes");
  }
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
    int64_t size = 0;
    for (const auto& [token, id] : model.at("vocab").items())
      size = std::max(size, id.get<int64_t>() + 1);
    for (const json& t : j.value("added_tokens", json::array()))
      size = std::max(size, t.at("id").get<int64_t>() + 1);
    v.tokens.assign(static_cast<size_t>(size), "");
    v.types.assign(static_cast<size_t>(size), Vocabulary::kUnused);
    for (const auto& [token, id] : model.at("vocab").items()) {
      v.tokens[id.get<size_t>()] = token;
      v.types[id.get<size_t>()] = Vocabulary::kNormal;
    }
    for (const json& t : j.value("added_tokens", json::array())) {
      const auto id = t.at("id").get<size_t>();
      v.tokens[id] = t.at("content").get<std::string>();
      v.types[id] = t.value("special", false) ? Vocabulary::kControl : Vocabulary::kUserDefined;
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
    std::vector<json> splits;
    collect(j.value("pre_tokenizer", json()), "Split", splits);
    v.pre = "gpt2";
    if (!splits.empty()) {
      const std::string pattern = splits[0].value("pattern", json::object()).value("Regex", "");
      v.pre.clear();
      for (const auto& [name, regex] : kHfPreTokenizers)
        if (pattern == regex) v.pre = name;
      if (v.pre.empty())
        throw UserError(where + ": a pre-tokenizer pattern cputrain does not know (" + pattern +
                        "); it knows those of gpt2, llama-bpe and qwen2");
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

}  // namespace cputrain
