#include "tools/model_source.h"

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "engine/error.h"
#include "engine/gguf_file.h"
#include "engine/vocab_tokenizer.h"
#include "models/gguf_model.h"
#include "models/hf_model.h"
#include "tools/run_config.h"
#include "tools/run_dir.h"

namespace cputrain {
namespace {

namespace fs = std::filesystem;

bool starts_with_gguf_magic(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  in.read(magic, 4);
  return in.gcount() == 4 && std::string(magic, 4) == "GGUF";
}

// Every parameter frozen and held as bf16 alone where `bf16`; the default model otherwise.
ModelOptions model_options(bool bf16) {
  ModelOptions o;
  if (bf16) {
    o.compute_dtype = DType::BF16;
    o.trainable = [](const std::string&) { return false; };
  }
  return o;
}

}  // namespace

LoadedModel load_model(const std::string& path, const std::string& flag, const std::string& weights,
                       int64_t max_ctx, bool bf16_when_exact) {
  LoadedModel m;
  std::error_code ec;
  if (fs::is_directory(path, ec) && is_hf_folder(path)) {
    if (!weights.empty())
      throw UserError("--weights " + weights + ": only for a run directory, not " + flag + " " +
                      path);
    m.config = hf_model_config(path, max_ctx);
    m.tokenizer = std::make_unique<Tokenizer>(hf_tokenizer(path));
    if (m.tokenizer->vocab_size() > m.config.vocab)
      throw UserError(path + ": the tokenizer has " + std::to_string(m.tokenizer->vocab_size()) +
                      " tokens, config.json's vocab_size " + std::to_string(m.config.vocab));
    const SafetensorsModel weights_files(path);
    bool all_bf16 = true;
    for (const std::string& name : weights_files.names()) {
      const SafetensorsTensor* t = weights_files.find(name);
      if (t->shape.size() == 2 && t->dtype != "BF16") all_bf16 = false;
    }
    m.bf16_weights = bf16_when_exact && all_bf16;
    m.model = std::make_unique<LlamaModel>(m.config, model_options(m.bf16_weights));
    load_hf_weights(weights_files, m.model->parameters());
    const Vocabulary v = m.tokenizer->to_vocabulary();
    m.strip_leading_space = m.tokenizer->vocabulary() && v.add_space_prefix;
    m.source = "Hugging Face folder " + path + (m.bf16_weights ? " (bf16 weights)" : "");
    return m;
  }
  if (fs::is_directory(path, ec)) {
    if (!fs::exists(fs::path(path) / "config.json"))
      throw UserError(flag + " " + path +
                      ": a folder without config.json (neither a cputrain run nor a model folder)");
    const RunConfig config = read_run_config(path + "/config.json");
    m.config = config.model;
    m.tokenizer = std::make_unique<Tokenizer>(Tokenizer::load_run(path));
    if (m.tokenizer->vocab_size() != m.config.vocab)
      throw UserError(path + "/tokenizer.model: vocabulary " +
                      std::to_string(m.tokenizer->vocab_size()) + " does not match the model's " +
                      std::to_string(m.config.vocab));
    m.model = std::make_unique<LlamaModel>(m.config);
    m.source = load_run_weights(path, weights, m.model->parameters());
    // A run begun from a model file keeps its tokenizer, dummy prefix and all.
    m.strip_leading_space =
        m.tokenizer->vocabulary() && m.tokenizer->vocabulary()->vocabulary().add_space_prefix;
    return m;
  }
  if (!fs::exists(path, ec)) throw UserError(flag + " " + path + ": no such file or folder");
  if (!weights.empty())
    throw UserError("--weights " + weights + ": only for a run directory, not " + flag + " " +
                    path);
  if (!starts_with_gguf_magic(path))
    throw UserError(flag + " " + path + ": not a GGUF file, a model folder or a run directory");
  const GgufFile file(path);
  m.config = gguf_model_config(file, max_ctx);
  Vocabulary vocabulary = gguf_vocabulary(file);
  if (static_cast<int64_t>(vocabulary.tokens.size()) != m.config.vocab)
    throw UserError(path + ": the tokenizer has " + std::to_string(vocabulary.tokens.size()) +
                    " tokens, the embedding " + std::to_string(m.config.vocab) + " rows");
  m.strip_leading_space = vocabulary.add_space_prefix;
  m.tokenizer = std::make_unique<Tokenizer>(Tokenizer::from_vocabulary(std::move(vocabulary)));
  bool all_bf16 = true;
  for (const GgufTensor& t : file.tensors())
    if (t.dims.size() == 2 && t.type != static_cast<uint32_t>(GgmlType::BF16)) all_bf16 = false;
  m.bf16_weights = bf16_when_exact && all_bf16;
  m.model = std::make_unique<LlamaModel>(m.config, model_options(m.bf16_weights));
  load_gguf_weights(file, m.model->parameters());
  m.source = "GGUF " + file.string("general.architecture") + ", " + path +
             (m.bf16_weights ? " (bf16 weights)" : "");
  return m;
}

namespace {

enum class SourceKind { Run, HuggingFace, Gguf };

SourceKind source_kind(const std::string& path, const std::string& flag) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    if (is_hf_folder(path)) return SourceKind::HuggingFace;
    if (fs::exists(fs::path(path) / "config.json")) return SourceKind::Run;
    throw UserError(flag + " " + path +
                    ": a folder without config.json (neither a cputrain run nor a model folder)");
  }
  if (!fs::exists(path, ec)) throw UserError(flag + " " + path + ": no such file or folder");
  if (!starts_with_gguf_magic(path))
    throw UserError(flag + " " + path + ": not a GGUF file, a model folder or a run directory");
  return SourceKind::Gguf;
}

}  // namespace

LlamaConfig load_model_config(const std::string& path, const std::string& flag, int64_t max_ctx) {
  switch (source_kind(path, flag)) {
    case SourceKind::HuggingFace:
      return hf_model_config(path, max_ctx);
    case SourceKind::Run: {
      LlamaConfig c = read_run_config(path + "/config.json").model;
      c.ctx = std::min(c.ctx, max_ctx);
      return c;
    }
    case SourceKind::Gguf:
      break;
  }
  return gguf_model_config(GgufFile(path), max_ctx);
}

void load_model_weights(const std::string& path, const std::string& flag,
                        const ParameterSet& params) {
  switch (source_kind(path, flag)) {
    case SourceKind::HuggingFace:
      return load_hf_weights(SafetensorsModel(path), params);
    case SourceKind::Run:
      load_run_weights(path, "", params);
      return;
    case SourceKind::Gguf:
      break;
  }
  load_gguf_weights(GgufFile(path), params);
}

Tokenizer load_tokenizer(const std::string& path, const std::string& flag) {
  std::error_code ec;
  if (fs::is_directory(path, ec) && is_hf_folder(path)) return hf_tokenizer(path);
  if (fs::is_directory(path, ec)) return Tokenizer::load_run(path);
  if (!fs::exists(path, ec)) throw UserError(flag + " " + path + ": no such file or folder");
  if (!starts_with_gguf_magic(path))
    throw UserError(flag + " " + path + ": not a GGUF file, a model folder or a run directory");
  return Tokenizer::from_vocabulary(gguf_vocabulary(GgufFile(path)));
}

}  // namespace cputrain
