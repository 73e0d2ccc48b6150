#include "tools/model_source.h"

#include <spdlog/fmt/fmt.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "engine/core/error.h"
#include "engine/core/memory.h"
#include "engine/io/gguf_file.h"
#include "engine/io/safetensors_file.h"
#include "engine/text/vocab_tokenizer.h"
#include "engine/train/checkpoint_file.h"
#include "models/architecture.h"
#include "models/gguf_model.h"
#include "models/hf_config.h"
#include "models/hf_tokenizer.h"
#include "models/lora.h"
#include "tools/run/run_config.h"
#include "tools/run/run_dir.h"

namespace cputrain {

namespace fs = std::filesystem;

bool starts_with_gguf_magic(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  in.read(magic, 4);
  return in.gcount() == 4 && std::string(magic, 4) == "GGUF";
}

namespace {

// A model to compute with, not to train: every parameter frozen (quantised and BF16 matrices may
// then be read in place).
ModelOptions model_options(bool bf16) {
  ModelOptions o;
  if (bf16) o.compute_dtype = DType::BF16;
  o.trainable = [](const std::string&) { return false; };
  return o;
}

enum class SourceKind { Run, HuggingFace, Gguf };

SourceKind source_kind(const std::string& path, const std::string& flag) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    if (is_hf_folder(path)) return SourceKind::HuggingFace;
    const fs::path config = fs::path(path) / "config.json";
    if (fs::exists(config)) {
      // A run's names its preset; one that is not JSON is left to read_run_config to name.
      std::ifstream in(config);
      const nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
      if (j.is_object() && !j.contains("preset"))
        throw UserError(flag + " " + path + ": " + config.string() +
                        " has no model_type (a Hugging Face model names its architecture there) "
                        "and is no cputrain run's configuration");
      return SourceKind::Run;
    }
    throw UserError(flag + " " + path +
                    ": a folder without config.json (neither a cputrain run nor a model folder)");
  }
  if (!fs::exists(path, ec)) throw UserError(flag + " " + path + ": no such file or folder");
  if (!starts_with_gguf_magic(path))
    throw UserError(flag + " " + path + ": not a GGUF file, a model folder or a run directory");
  return SourceKind::Gguf;
}

// What a fine-tune's run directory gives as a model: its base, and its result (the adapter or,
// of --full, the whole model).
struct FinetuneRun {
  std::string base;  // the model it fine-tuned
  bool full = false;
  LoraConfig lora;  // of a LoRA fine-tune
  DType dtype = DType::F32;
  std::string result;          // adapter.gguf or model.gguf where written, else empty
  std::string method = "sft";  // or dpo, orpo
};

std::optional<FinetuneRun> finetune_run(const std::string& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return std::nullopt;
  std::ifstream in(fs::path(path) / "config.json");
  if (!in) return std::nullopt;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception&) {
    // Whatever the folder is, what it is cannot be told: named here, not taken for another kind.
    throw UserError(path + "/config.json: not valid JSON (damaged?)");
  }
  if (!j.is_object() || j.value("command", std::string()) != "finetune") return std::nullopt;
  FinetuneRun r;
  try {
    r.base = j.at("model").get<std::string>();
    r.full = j.at("full").get<bool>();
    r.dtype = j.at("dtype").get<std::string>() == "bf16" ? DType::BF16 : DType::F32;
    r.method = j.value("method", r.method);
    if (!r.full) {
      r.lora.rank = j.at("lora_rank").get<int64_t>();
      r.lora.alpha = j.at("lora_alpha").get<double>();
      r.lora.targets = parse_lora_targets(j.at("lora_targets").get<std::string>(),
                                          path + "/config.json: lora_targets");
    }
  } catch (const nlohmann::json::exception&) {
    throw UserError(path + "/config.json: malformed fine-tune configuration");
  }
  const fs::path result = fs::path(path) / (r.full ? "model.gguf" : "adapter.gguf");
  if (fs::exists(result, ec)) r.result = result.string();
  return r;
}

}  // namespace

// load_model, with the options a training run builds the model with (null: as bf16_when_exact
// says).
LoadedModel load_model(const std::string& path, const std::string& flag, const std::string& weights,
                       int64_t max_ctx, bool bf16_when_exact, const ModelOptions* training,
                       const std::string& adapter);

LoadedModel load_model(const std::string& path, const std::string& flag, const std::string& weights,
                       int64_t max_ctx, bool bf16_when_exact, const std::string& adapter) {
  return load_model(path, flag, weights, max_ctx, bf16_when_exact, nullptr, adapter);
}

LoadedModel load_model_to_train(const std::string& path, const std::string& flag, int64_t max_ctx,
                                const ModelOptions& options) {
  return load_model(path, flag, "", max_ctx, false, &options, "");
}

namespace {

// A fine-tune's run as load_model reads it: the base with the adapter the run wrote, or with the
// adapters of its checkpoint (`weights`, else the newest) for a run that stopped; of --full, the
// model it wrote, or its checkpoint's weights.
namespace {

// gguf-py's Metadata.id_to_title: '-' as spaces, each word in lower case titled unless a
// version or a number ("v2", "0.5b").
std::string id_to_title(const std::string& id) {
  std::string out, word;
  std::string spaced = id;
  std::replace(spaced.begin(), spaced.end(), '-', ' ');
  std::istringstream words(spaced);
  while (words >> word) {
    const bool lower =
        std::any_of(word.begin(), word.end(), [](unsigned char c) { return std::isalpha(c); }) &&
        std::none_of(word.begin(), word.end(), [](unsigned char c) { return std::isupper(c); });
    const bool version_or_number =
        std::isdigit(static_cast<unsigned char>(word[0])) ||
        (word.size() > 1 && word[0] == 'v' && std::isdigit(static_cast<unsigned char>(word[1])) &&
         word.find_first_not_of("0123456789.", 1) == std::string::npos);
    if (lower && !version_or_number) {
      // Python's str.title: a letter after a non-letter upper, the others lower.
      bool after_letter = false;
      for (char& c : word) {
        const auto u = static_cast<unsigned char>(c);
        c = static_cast<char>(after_letter ? std::tolower(u) : std::toupper(u));
        after_letter = std::isalpha(u) != 0;
      }
    }
    out += (out.empty() ? "" : " ") + word;
  }
  return out;
}

// The last name of `path`, a trailing separator or not.
std::string folder_name(const std::string& path) {
  const fs::path p = fs::path(path).lexically_normal();
  return (p.has_filename() ? p : p.parent_path()).filename().string();
}

// A Hugging Face folder's name as llama.cpp's converter takes it: config.json's _name_or_path
// where it is a hub id ("org/name", not a path on the machine that wrote it), else the folder's
// name; as a title.
std::string hf_model_name(const std::string& folder) {
  std::ifstream in(fs::path(folder) / "config.json");
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
  std::string name;
  if (j.is_object() && j.contains("_name_or_path") && j["_name_or_path"].is_string())
    name = j["_name_or_path"].get<std::string>();
  if (name.empty() || std::count(name.begin(), name.end(), '/') > 1) name = folder_name(folder);
  return id_to_title(name.substr(name.find('/') + 1));
}

}  // namespace

LoadedModel load_finetune_run(const FinetuneRun& run, const std::string& path,
                              const std::string& flag, const std::string& weights, int64_t max_ctx,
                              bool bf16_when_exact, const ModelOptions* training,
                              const std::string& adapter) {
  if (!adapter.empty())
    throw UserError("--adapter " + adapter + ": " + flag + " " + path +
                    " is a fine-tune, whose adapter is its own");
  if (training && !run.full)
    throw UserError(flag + " " + path +
                    " is a LoRA fine-tune: write its base with the adapter merged (cputrain export "
                    "--run " +
                    path + " --merge --out MODEL.gguf) and give that");
  // The base is named in its config.json: where it is gone, that is said, not a flag.
  std::error_code ec;
  if (!run.full || run.result.empty() || !weights.empty())
    if (!fs::exists(run.base, ec))
      throw UserError(flag + " " + path + ": the base it fine-tuned, " + run.base + " (" + path +
                      "/config.json's model), is not there");
  LoadedModel m;
  if (weights.empty() && !run.result.empty()) {
    m = run.full ? load_model(run.result, flag, "", max_ctx, bf16_when_exact, training, "")
                 : load_model(run.base, flag, "", max_ctx, bf16_when_exact, training, run.result);
  } else {
    const auto checkpoints = list_checkpoints(path);
    if (weights.empty() && checkpoints.empty())
      throw UserError(flag + " " + path + ": a fine-tune with neither " +
                      (run.full ? "model.gguf" : "adapter.gguf") + " nor a checkpoint to read");
    const std::string checkpoint = weights.empty() ? checkpoints.back().second : weights;
    // Built as the fine-tune trained it, so the checkpoint's parameters fit.
    ModelOptions options = training ? *training : ModelOptions{};
    options.compute_dtype = run.dtype;
    options.lora = run.lora;
    m = load_model(run.base, flag, "", max_ctx, false, &options, "");
    load_checkpoint(checkpoint, m.model->parameters(), nullptr);
    m.source +=
        ", with the " + std::string(run.full ? "weights" : "adapters") + " of " + checkpoint;
  }
  m.source = "the fine-tune " + path + ": " + m.source;
  return m;
}

}  // namespace

LoadedModel load_model(const std::string& path, const std::string& flag, const std::string& weights,
                       int64_t max_ctx, bool bf16_when_exact, const ModelOptions* training,
                       const std::string& adapter) {
  if (const auto run = finetune_run(path))
    return load_finetune_run(*run, path, flag, weights, max_ctx, bf16_when_exact, training,
                             adapter);
  const SourceKind kind = source_kind(path, flag);
  if (kind != SourceKind::Run && !weights.empty())
    throw UserError("--weights " + weights + ": only for a run directory, not " + flag + " " +
                    path);
  LoadedModel m;
  // Each file is opened once: its configuration, tokenizer and weights come from the one copy.
  std::shared_ptr<GgufFile> gguf;
  std::shared_ptr<SafetensorsModel> safetensors;
  std::string hf_left_out;  // what of a Hugging Face folder the model leaves out
  bool all_bf16 = false;    // every matrix of the file is BF16
  switch (kind) {
    case SourceKind::Run:
      m.config = read_run_config(path + "/config.json").model;
      m.tokenizer = std::make_unique<Tokenizer>(Tokenizer::load_run(path));
      break;
    case SourceKind::HuggingFace:
      safetensors = std::make_shared<SafetensorsModel>(hf_weights(path, &hf_left_out));
      m.config = hf_model_config(path, *safetensors, INT64_MAX);
      check_hf_weights(*safetensors, m.config);
      m.tokenizer = std::make_unique<Tokenizer>(hf_tokenizer(path));
      all_bf16 = true;
      for (const std::string& name : safetensors->names())
        if (safetensors->find(name)->shape.size() == 2 && safetensors->find(name)->dtype != "BF16")
          all_bf16 = false;
      break;
    case SourceKind::Gguf:
      gguf = std::make_shared<GgufFile>(path);
      m.config = gguf_model_config(*gguf, INT64_MAX);
      check_gguf_weights(*gguf, m.config);
      m.tokenizer = std::make_unique<Tokenizer>(Tokenizer::from_vocabulary(gguf_vocabulary(*gguf)));
      all_bf16 = true;
      for (const GgufTensor& t : gguf->tensors())
        if (t.dims.size() == 2 && t.type != static_cast<uint32_t>(GgmlType::BF16)) all_bf16 = false;
      break;
  }
  m.host_bytes = (gguf ? gguf->heap_bytes() : 0) + m.tokenizer->heap_bytes();
  // A model file's context is capped (a run's is what it trained with).
  m.declared_ctx = m.config.ctx;
  if (kind != SourceKind::Run) m.config.ctx = std::min(m.config.ctx, max_ctx);
  // An embedding may have rows past the tokenizer's last id (padding), never fewer.
  if (m.tokenizer->vocab_size() > m.config.vocab)
    throw UserError(path + ": the tokenizer has " + std::to_string(m.tokenizer->vocab_size()) +
                    " tokens, the model's embedding " + std::to_string(m.config.vocab) + " rows");
  m.bf16_weights = bf16_when_exact && all_bf16;
  ModelOptions options = training ? *training : model_options(m.bf16_weights);
  // --adapter: the model built with the file's adapters, which load after the base.
  std::unique_ptr<GgufFile> adapter_file;
  if (!adapter.empty()) {
    adapter_file = std::make_unique<GgufFile>(adapter);
    options.lora = lora_gguf_config(*adapter_file);
    check_lora_rank(m.config, options.lora, "--adapter " + adapter + ": rank");
  }
  // The frozen matrices are read in place where the file's type allows: mapped, not copied.
  // Quantised ones in either precision; BF16 ones held as bf16 alone (a bf16 model's).
  if (gguf) {
    options.in_place = [&](const ParameterInfo& p) { return gguf_in_place(*gguf, p, m.config); };
    options.mapped_owner = gguf;
  } else if (safetensors) {
    options.in_place = [&](const ParameterInfo& p) {
      return hf_in_place(*safetensors, p, m.config);
    };
    options.mapped_owner = safetensors;
  }
  m.model = std::make_unique<DecoderModel>(m.config, options);
  bool mapped = false, quantized = false;
  for (const ParameterInfo& p : m.model->parameters().infos()) {
    mapped = mapped || p.mapped;
    quantized = quantized || (p.mapped && dtype_quantized(p.mapped_dtype));
  }
  const std::string held = quantized        ? " (quantised weights read in place)"
                           : mapped         ? " (bf16 weights read in place)"
                           : m.bf16_weights ? " (bf16 weights)"
                                            : "";
  switch (kind) {
    case SourceKind::Run:
      m.source = load_run_weights(path, weights, m.model->parameters());
      break;
    case SourceKind::HuggingFace:
      load_hf_weights(*safetensors, m.model->parameters(), m.config);
      m.source = "Hugging Face folder " + path + held + hf_left_out;
      break;
    case SourceKind::Gguf:
      load_gguf_weights(*gguf, m.model->parameters(), m.config);
      m.source = "GGUF " + gguf->string("general.architecture") + ", " + path + held +
                 gguf_left_out(*gguf, m.config);
      break;
  }
  switch (kind) {
    case SourceKind::Run:
      m.name = id_to_title(folder_name(path));
      break;
    case SourceKind::HuggingFace:
      m.naming = TensorNaming::HuggingFace;
      m.name = hf_model_name(path);
      break;
    case SourceKind::Gguf:
      m.naming = TensorNaming::Gguf;
      m.name = gguf->string("general.name", "");
      break;
  }
  if (adapter_file) {
    m.adapter_file = adapter;
    load_lora_gguf(*adapter_file, m.config, m.model->parameters());
    m.source +=
        ", with the LoRA adapter " + adapter + " (rank " + std::to_string(options.lora.rank) + ")";
  }
  return m;
}

std::function<InPlaceWeight(const ParameterInfo&)> in_place_weights(const std::string& path,
                                                                    const std::string& flag,
                                                                    const ModelConfig& config) {
  const SourceKind kind = source_kind(path, flag);
  if (kind == SourceKind::Gguf) {
    auto gguf = std::make_shared<GgufFile>(path);
    return [gguf, config](const ParameterInfo& p) { return gguf_in_place(*gguf, p, config); };
  }
  if (kind == SourceKind::HuggingFace) {
    auto safetensors = std::make_shared<SafetensorsModel>(hf_weights(path));
    return [safetensors, config](const ParameterInfo& p) {
      return hf_in_place(*safetensors, p, config);
    };
  }
  return nullptr;
}

void check_finite_weights(const LoadedModel& m, const std::string& path, const std::string& flag,
                          const std::string& adapter) {
  const Architecture& arch = architecture_of(m.config);
  const auto named = [&arch](std::optional<TensorNaming> naming) {
    return [&arch, naming](const std::string& name) {
      return naming ? tensor_name(name, *naming, arch) : name;
    };
  };
  check_finite(
      m.model->parameters(), flag + " " + path,
      [](const std::string& name) { return !is_lora_parameter(name); }, named(m.naming));
  // A fine-tune's adapter (its adapter.gguf, or the checkpoint's adapters) or --adapter's.
  check_finite(
      m.model->parameters(),
      !adapter.empty()          ? "--adapter " + adapter
      : !m.adapter_file.empty() ? flag + " " + path + ": " + m.adapter_file
                                : flag + " " + path,
      [](const std::string& name) { return is_lora_parameter(name); },
      named(m.adapter_file.empty() ? std::nullopt : std::optional(TensorNaming::Gguf)));
}

bool is_lora_finetune(const std::string& path) {
  const auto run = finetune_run(path);
  return run && !run->full;
}

std::optional<std::string> describe_finetune_run(const std::string& path) {
  const auto run = finetune_run(path);
  if (!run) return std::nullopt;
  std::string what = run->full ? "a fine-tune of every parameter"
                               : "a LoRA fine-tune (rank " + std::to_string(run->lora.rank) +
                                     ", alpha " + fmt::format("{:g}", run->lora.alpha) + " on " +
                                     lora_targets_text(run->lora.targets) + ")";
  if (run->method != "sft") {
    std::string method = run->method;
    for (char& c : method) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    what += " by " + method;
  }
  const auto checkpoints = list_checkpoints(path);
  return what + " of " + run->base + ": " +
         (!run->result.empty()   ? run->result
          : !checkpoints.empty() ? "stopped at " + checkpoints.back().second
                                 : std::string("nothing trained yet"));
}

ModelConfig load_model_config(const std::string& path, const std::string& flag, int64_t max_ctx) {
  // A fine-tune has its base's shape.
  if (const auto run = finetune_run(path)) return load_model_config(run->base, flag, max_ctx);
  switch (source_kind(path, flag)) {
    case SourceKind::HuggingFace: {
      const SafetensorsModel weights = hf_weights(path);
      const ModelConfig c = hf_model_config(path, weights, max_ctx);
      check_hf_weights(weights, c);
      return c;
    }
    case SourceKind::Run: {
      ModelConfig c = read_run_config(path + "/config.json").model;
      c.ctx = std::min(c.ctx, max_ctx);
      return c;
    }
    case SourceKind::Gguf:
      break;
  }
  const GgufFile file(path);
  const ModelConfig c = gguf_model_config(file, max_ctx);
  check_gguf_weights(file, c);
  return c;
}

void load_model_weights(const std::string& path, const std::string& flag,
                        const ParameterSet& params) {
  // A fine-tune's weights: its base with the adapter merged, or what --full trained.
  if (finetune_run(path)) {
    const LoadedModel m = load_model(path, flag, "", INT64_MAX, false, nullptr, "");
    if (m.model->lora().active()) {
      merge_lora(m.config, m.model->parameters(), m.model->lora(), params);
      return;
    }
    std::vector<float> values;
    for (size_t i = 0; i < params.infos().size(); ++i) {
      values.resize(static_cast<size_t>(params.infos()[i].shape.numel()));
      m.model->parameters().read_values(static_cast<int>(i), values.data());
      params.write_values(static_cast<int>(i), values.data());
    }
    return;
  }
  switch (source_kind(path, flag)) {
    case SourceKind::HuggingFace: {
      const SafetensorsModel weights = hf_weights(path);
      return load_hf_weights(weights, params, hf_model_config(path, weights, INT64_MAX));
    }
    case SourceKind::Run:
      load_run_weights(path, "", params);
      return;
    case SourceKind::Gguf:
      break;
  }
  const GgufFile file(path);
  load_gguf_weights(file, params, gguf_model_config(file, INT64_MAX));
}

void add_model_source_flags(CLI::App& app, std::string& run, std::string& model) {
  auto* r = app.add_option("--run", run, "Run directory written by `cputrain train`");
  auto* m =
      app.add_option("--model", model, "A run directory, a GGUF file or a Hugging Face folder");
  r->excludes(m);
  m->excludes(r);
}

std::pair<std::string, std::string> model_source(const std::string& run, const std::string& model) {
  if (run.empty() && model.empty()) throw UserError("--run or --model is required");
  if (model.empty()) {
    std::error_code ec;
    if (!fs::is_directory(run, ec)) throw UserError("--run " + run + ": no such run directory");
    return {run, "--run"};
  }
  return {model, "--model"};
}

int64_t model_host_bytes(const std::string& path, const std::string& flag) {
  if (const auto run = finetune_run(path)) return model_host_bytes(run->base, flag);
  const int64_t file =
      source_kind(path, flag) == SourceKind::Gguf ? GgufFile(path).heap_bytes() : 0;
  return file + load_tokenizer(path, flag).heap_bytes();
}

Tokenizer load_tokenizer(const std::string& path, const std::string& flag) {
  if (const auto run = finetune_run(path)) return load_tokenizer(run->base, flag);
  switch (source_kind(path, flag)) {
    case SourceKind::HuggingFace:
      return hf_tokenizer(path);
    case SourceKind::Run:
      return Tokenizer::load_run(path);
    case SourceKind::Gguf:
      break;
  }
  return Tokenizer::from_vocabulary(gguf_vocabulary(GgufFile(path)));
}

}  // namespace cputrain
