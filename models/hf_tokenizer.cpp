#include "models/hf_tokenizer.h"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "engine/core/error.h"
#include "engine/text/tokenizer.h"
#include "engine/text/vocab_tokenizer.h"
#include "models/hf_json.h"

namespace cputrain {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

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
  // Gemma 4's (model_type gemma4, gemma4_text): BPE by rank on the text's bytes, spaces as U+2581.
  const json model_config =
      fs::exists(dir / "config.json") ? read_json(dir / "config.json") : json::object();
  const bool gemma4 = spm && model_config.is_object() &&
                      model_config.value("model_type", std::string()).starts_with("gemma4");
  // Other SentencePiece-style vocabularies: their own SentencePiece model is the reference.
  if (spm && !gemma4 && fs::exists(dir / "tokenizer.model"))
    return Tokenizer::load((dir / "tokenizer.model").string());
  Vocabulary v;
  v.model = gemma4 ? "gemma4" : spm ? "llama" : "gpt2";
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
    std::unordered_map<std::string, size_t> id_of;
    for (size_t i = 0; i < v.tokens.size(); ++i) id_of.emplace(v.tokens[i], i);
    if (gemma4) {
      v.pre = "gemma4";  // its merges are its ranks, kept
    } else {
      // Pieces merge by score; a BPE vocabulary's merges are ranks: a merged piece scores minus
      // the rank of the merge that makes it.
      v.scores.assign(v.tokens.size(), 0.0f);
      for (size_t r = 0; r < v.merges.size(); ++r) {
        const std::string& m = v.merges[r];
        const size_t space = m.find(' ');
        const auto it = id_of.find(m.substr(0, space) + m.substr(space + 1));
        if (it != id_of.end() && v.scores[it->second] == 0.0f)
          v.scores[it->second] = -static_cast<float>(r + 1);
      }
      v.merges.clear();
    }
    for (size_t i = 0; i < v.tokens.size(); ++i) {
      const std::string& t = v.tokens[i];
      if (t.size() == 6 && t.starts_with("<0x") && t.back() == '>') v.types[i] = Vocabulary::kByte;
    }
    std::vector<json> prepends;
    collect(j.value("normalizer", json()), "Prepend", prepends);
    std::vector<json> metaspace;
    collect(j.value("pre_tokenizer", json()), "Metaspace", metaspace);
    v.add_space_prefix =
        !gemma4 &&
        (!prepends.empty() ||
         (!metaspace.empty() && metaspace[0].value("prepend_scheme", "always") != "never"));
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
    if (model_config.contains("eos_token_id") && model_config["eos_token_id"].is_number_integer())
      v.eos = model_config["eos_token_id"].get<int32_t>();
  }
  v.add_bos = (config.value("add_bos_token", spm || v.pre == "llama-bpe") || gemma4) && v.bos >= 0;
  v.add_eos = config.value("add_eos_token", false);
  if (config.contains("chat_template") && config["chat_template"].is_string())
    v.chat_template = config["chat_template"].get<std::string>();
  return Tokenizer::from_vocabulary(std::move(v));
}

}  // namespace cputrain
