#include "tools/inspect_command.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "engine/core/error.h"
#include "engine/core/memory.h"
#include "engine/io/gguf_file.h"
#include "engine/io/safetensors_file.h"
#include "engine/text/vocab_tokenizer.h"
#include "models/architecture.h"
#include "models/config_json.h"
#include "models/gguf_model.h"
#include "models/hf_config.h"
#include "models/hf_tokenizer.h"
#include "models/lora.h"
#include "models/memory_budget.h"
#include "tools/budget_command.h"
#include "tools/model_source.h"
#include "tools/run/run_config.h"
#include "tools/train_command.h"

namespace cputrain {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// The training budget inspect shows: 8 sequences of up to 512 tokens, the dtype train would
// choose, no checkpointing.
constexpr int64_t kInspectBatch = 8, kInspectCtx = 512;

json vocabulary_json(const Vocabulary& v) {
  const auto token = [&](int32_t id) {
    return id >= 0 && id < static_cast<int32_t>(v.tokens.size()) ? json(v.tokens[id]) : json();
  };
  return {{"model", v.model},
          {"pre", v.pre},
          {"tokens", v.tokens.size()},
          {"merges", v.merges.size()},
          {"bos", {{"id", v.bos}, {"text", token(v.bos)}}},
          {"eos", {{"id", v.eos}, {"text", token(v.eos)}}},
          {"add_bos", v.add_bos},
          {"add_eos", v.add_eos},
          {"add_space_prefix", v.add_space_prefix},
          {"chat_template", v.chat_template}};
}

}  // namespace

void add_inspect_flags(CLI::App& app, InspectArgs& a) {
  app.add_option("path", a.path, "A GGUF file, a Hugging Face folder or a run directory")
      ->required();
  app.add_flag("--json", a.json, "Print it all as JSON");
}

namespace {

// A LoRA adapter file: what it adapts, and how to apply it.
int inspect_adapter(const InspectArgs& a, const GgufFile& file) {
  const LoraConfig lora = lora_gguf_config(file);
  const json j = {{"format", "GGUF v" + std::to_string(file.version())},
                  {"type", "LoRA adapter"},
                  {"architecture", file.string("general.architecture", "")},
                  {"name", file.string("general.name", "")},
                  {"rank", lora.rank},
                  {"alpha", lora.alpha},
                  {"targets", lora_targets_text(lora.targets)},
                  {"tensors", file.tensors().size()}};
  if (a.json) {
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf(
      "%s: a LoRA adapter (GGUF v%u) for %s models: rank %lld, alpha %g on %s, %zu tensors\n"
      "  apply it with --adapter (sample, eval, export --merge) or llama.cpp's --lora\n",
      a.path.c_str(), file.version(), file.string("general.architecture", "").c_str(),
      static_cast<long long>(lora.rank), lora.alpha, lora_targets_text(lora.targets).c_str(),
      file.tensors().size());
  return 0;
}

}  // namespace

int run_inspect(const InspectArgs& a) {
  json j;
  ModelConfig config;
  Vocabulary vocabulary;
  std::error_code ec;
  if (fs::is_directory(a.path, ec) && is_hf_folder(a.path)) {
    config = hf_model_config(a.path, INT64_MAX);
    vocabulary = hf_tokenizer(a.path).to_vocabulary();
    j["format"] = "Hugging Face folder";
    const SafetensorsModel weights = hf_weights(a.path);
    std::map<std::string, int64_t> types, bytes;
    for (const std::string& name : weights.names()) {
      const SafetensorsTensor* t = weights.find(name);
      types[t->dtype] += 1;
      bytes[t->dtype] += static_cast<int64_t>(t->data.size());
    }
    j["tensors"] = json::object();
    for (const auto& [type, n] : types) j["tensors"][type] = {{"count", n}, {"bytes", bytes[type]}};
  } else if (const auto finetune = describe_finetune_run(a.path)) {
    config = load_model_config(a.path, "inspect", INT64_MAX);
    vocabulary = load_tokenizer(a.path, "inspect").to_vocabulary();
    j["format"] = "cputrain fine-tune";
    j["name"] = *finetune;
  } else if (fs::is_directory(a.path, ec)) {
    const RunConfig run = read_run_config(a.path + "/config.json");
    config = run.model;
    j["format"] = "cputrain run";
    vocabulary = Tokenizer::load_run(a.path).to_vocabulary();
  } else {
    if (starts_with_gguf_magic(a.path)) {
      const GgufFile adapter(a.path);
      if (adapter.string("general.type", "") == "adapter") return inspect_adapter(a, adapter);
    }
    const Tokenizer probe = load_tokenizer(a.path, "inspect");  // a UserError for non-GGUF
    const GgufFile file(a.path);
    config = gguf_model_config(file, INT64_MAX);
    vocabulary = probe.to_vocabulary();
    j["format"] = "GGUF v" + std::to_string(file.version());
    j["name"] = file.string("general.name", "");
    std::map<std::string, int64_t> types, bytes;
    for (const GgufTensor& t : file.tensors()) {
      types[ggml_type_name(t.type)] += 1;
      bytes[ggml_type_name(t.type)] += static_cast<int64_t>(t.data.size());
    }
    j["tensors"] = json::object();
    for (const auto& [type, n] : types) j["tensors"][type] = {{"count", n}, {"bytes", bytes[type]}};
  }
  j["config"] = model_config_json(config);
  j["architecture"] = config.architecture;
  j["parts"] = std::string(architecture_of(config).summary);
  j["tokenizer"] = vocabulary_json(vocabulary);
  RunConfig plan;
  plan.model = config;
  plan.model.ctx = std::min(config.ctx, kInspectCtx);
  plan.train.batch = kInspectBatch;
  plan.train.ctx = plan.model.ctx;
  std::string why;
  plan.dtype = choose_dtype("", &why);
  plan.threads = 1;
  const MemoryBudget budget = memory_budget(plan.model, budget_options(plan, 0, 0));
  const int64_t available = available_memory_bytes();
  j["training_budget"] = {{"batch", kInspectBatch},
                          {"ctx", plan.model.ctx},
                          {"dtype", plan.dtype == DType::BF16 ? "bf16" : "fp32"},
                          {"total_bytes", budget.total_bytes()},
                          {"available_bytes", available},
                          {"fits", available <= 0 || budget.total_bytes() <= available}};
  if (a.json) {
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("%s: %s, architecture %s%s\n", a.path.c_str(), j["format"].get<std::string>().c_str(),
              j["architecture"].get<std::string>().c_str(),
              j.contains("name") && !j["name"].get<std::string>().empty()
                  ? (" (" + j["name"].get<std::string>() + ")").c_str()
                  : "");
  const ModelConfig& c = config;
  std::printf(
      "  %lld parameters: d_model %lld, layers %lld, heads %lld, kv heads %lld, head dim %lld, "
      "ffn %lld, vocab %lld, ctx %lld\n  %s\n  %s: %s\n",
      static_cast<long long>(parameter_count(c)), static_cast<long long>(c.d_model),
      static_cast<long long>(c.n_layers), static_cast<long long>(c.n_heads),
      static_cast<long long>(c.kv_heads()), static_cast<long long>(c.head_size()),
      static_cast<long long>(c.ffn), static_cast<long long>(c.vocab), static_cast<long long>(c.ctx),
      describe_parts(c).c_str(), c.architecture.c_str(),
      std::string(architecture_of(c).summary).c_str());
  if (j.contains("tensors")) {
    std::printf("  tensors:");
    for (const auto& [type, v] : j["tensors"].items())
      std::printf(" %s x%lld (%s)", type.c_str(), static_cast<long long>(v["count"].get<int64_t>()),
                  format_bytes(v["bytes"].get<int64_t>()).c_str());
    std::printf("\n");
  }
  const json& t = j["tokenizer"];
  std::printf("  tokenizer: %s%s, %zu tokens, BOS %d, EOS %d, add BOS %s, dummy prefix %s\n",
              vocabulary.model.c_str(),
              vocabulary.pre.empty() ? "" : (" (" + vocabulary.pre + ")").c_str(),
              vocabulary.tokens.size(), vocabulary.bos, vocabulary.eos,
              vocabulary.add_bos ? "yes" : "no", vocabulary.add_space_prefix ? "yes" : "no");
  (void)t;
  if (!vocabulary.chat_template.empty())
    std::printf("  chat template:\n%s\n", vocabulary.chat_template.c_str());
  std::printf(
      "  training memory (batch %lld x ctx %lld, %s, no checkpointing): %s of %s available\n",
      static_cast<long long>(kInspectBatch), static_cast<long long>(plan.model.ctx),
      plan.dtype == DType::BF16 ? "bf16" : "fp32", format_bytes(budget.total_bytes()).c_str(),
      format_bytes(available).c_str());
  return 0;
}

void add_tokenize_flags(CLI::App& app, TokenizeArgs& a) {
  app.add_option("--model", a.model, "A GGUF file (a vocabulary-only one will do) or a run")
      ->required();
  app.add_option("--text", a.text, "A text file (default: standard input)");
  app.add_flag("--no-bos", a.no_bos, "No BOS first, even where the tokenizer adds one");
  app.add_flag("--special", a.special,
               "Special tokens in the text (such as <|im_start|>) are those tokens");
  app.add_flag("--json", a.json, "Print [{id, piece}] as JSON");
}

int run_tokenize(const TokenizeArgs& a) {
  const Tokenizer tokenizer = load_tokenizer(a.model, "--model");
  std::string text;
  if (a.text.empty()) {
    text.assign(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
  } else {
    if (fs::is_directory(a.text))
      throw UserError("--text " + a.text + ": a folder, not a text file");
    std::ifstream in(a.text, std::ios::binary);
    if (!in) throw UserError("--text " + a.text + ": cannot be read");
    std::stringstream s;
    s << in.rdbuf();
    text = s.str();
  }
  const Vocabulary vocabulary = tokenizer.to_vocabulary();
  std::vector<int32_t> ids;
  if (!a.no_bos && vocabulary.add_bos && vocabulary.bos >= 0) ids.push_back(vocabulary.bos);
  const std::vector<int32_t> encoded = tokenizer.vocabulary()
                                           ? tokenizer.vocabulary()->encode(text, a.special)
                                           : tokenizer.encode(text);
  ids.insert(ids.end(), encoded.begin(), encoded.end());
  if (a.json) {
    json j = json::array();
    for (int32_t id : ids)
      j.push_back({{"id", id}, {"piece", vocabulary.tokens[static_cast<size_t>(id)]}});
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  for (size_t i = 0; i < ids.size(); ++i) std::printf("%s%d", i ? " " : "", ids[i]);
  std::printf("\n");
  return 0;
}

}  // namespace cputrain
