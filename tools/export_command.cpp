#include "tools/export_command.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>

#include "engine/core/error.h"
#include "engine/train/parameters.h"
#include "models/decoder.h"
#include "models/gguf_model.h"
#include "models/hf_writer.h"
#include "models/lora.h"
#include "tools/model_source.h"

namespace cputrain {

void add_export_flags(CLI::App& app, ExportArgs& a) {
  add_model_source_flags(app, a.run, a.model);
  app.add_option(
      "--weights", a.weights,
      "A run's model.bin or checkpoint (default: model.bin, else the newest checkpoint)");
  app.add_option("--out", a.out,
                 "FILE.gguf: a GGUF file; any other name: a Hugging Face folder (config.json, "
                 "model.safetensors, tokenizer files)")
      ->required();
  app.add_option("--type", a.type,
                 "Type of the matrices: f32, f16, bf16, q8_0, or q4_k (Q4_K_M's mix of Q4_K and "
                 "Q6_K, as llama.cpp's Q4_K_M files); norms and biases stay f32")
      ->capture_default_str()
      ->check(CLI::IsMember({"f32", "f16", "bf16", "q8_0", "q4_k"}));
  app.add_option("--adapter", a.adapter,
                 "A LoRA adapter file (llama.cpp's GGUF, as cputrain finetune writes it)");
  app.add_flag("--merge", a.merge, "Write the model with --adapter merged into its weights");
  app.add_flag("--overwrite", a.overwrite, "Replace --out if it exists");
}

int run_export(const ExportArgs& a) {
  const auto [source, flag] = model_source(a.run, a.model);
  if (!a.adapter.empty() && !a.merge)
    throw UserError("--adapter " + a.adapter + ": give --merge to write the model with it merged");
  if (a.merge && a.adapter.empty() && !is_lora_finetune(source))
    throw UserError("--merge: give the adapter (--adapter FILE)");
  if (!a.merge && is_lora_finetune(source))
    throw UserError(flag + " " + source +
                    " is a LoRA fine-tune: give --merge to write its base with the adapter merged "
                    "(the adapter alone is its adapter.gguf, and PEFT's its peft/)");
  const bool gguf = a.out.ends_with(".gguf");
  if (!gguf && (a.type == "q8_0" || a.type == "q4_k"))
    throw UserError("--type " + a.type +
                    ": only for a GGUF file (--out FILE.gguf); a Hugging Face folder "
                    "takes f32, f16 or bf16");
  std::error_code ec;
  const bool exists = std::filesystem::exists(a.out, ec);
  if (exists && !a.overwrite &&
      (gguf || !std::filesystem::is_directory(a.out, ec) || !std::filesystem::is_empty(a.out, ec)))
    throw UserError("--out " + a.out + ": exists; choose another name or give --overwrite");
  if (exists && !gguf && !std::filesystem::is_directory(a.out, ec))
    throw UserError("--out " + a.out + ": a file, where a Hugging Face folder is to be written");
  // The model is built with a context of its own (its RoPE table holds ctx rows) and written with
  // the one its file declares. Its quantised and BF16 matrices stay in its file, read in place,
  // and each tensor is converted (and merged) as it is written: the export holds one tensor
  // beside the file's pages.
  LoadedModel m = load_model(source, flag, a.weights, kDefaultImportCtx, true, a.adapter);
  check_finite_weights(m, source, flag, a.adapter);
  ValueReader read;
  if (m.model->lora().active()) {
    // The base with the adapter merged, projection by projection as the writer reads them.
    const std::string merging =
        "--merge " + (a.adapter.empty() ? "the adapter of " : a.adapter + " into ") + source;
    read = [&m, merging](int index, float* values) {
      const ParameterSet& params = m.model->parameters();
      merged_values(m.config, params, m.model->lora(), index, values);
      const ParameterInfo& info = params.infos()[static_cast<size_t>(index)];
      for (int64_t i = 0; i < info.shape.numel(); ++i)
        if (!std::isfinite(values[i]))
          throw UserError(merging + ": " + info.name + " merged holds " +
                          (std::isnan(values[i]) ? "nan"
                           : values[i] > 0       ? "inf"
                                                 : "-inf") +
                          " (element " + std::to_string(i) +
                          "), and cputrain writes finite weights only");
    };
  }
  m.config.ctx = m.declared_ctx;
  GgufExport options;
  options.type = a.type == "f16"    ? GgmlType::F16
                 : a.type == "bf16" ? GgmlType::BF16
                 : a.type == "q8_0" ? GgmlType::Q8_0
                 : a.type == "q4_k" ? GgmlType::Q4_K
                                    : GgmlType::F32;
  // As llama.cpp's converter names it (the source's own name): never the file's, which llama.cpp
  // would read as a hint of the model ("phi3.gguf").
  options.name = m.name;
  options.read = read;
  if (!gguf) {
    const std::string dtype = a.type == "f16" ? "F16" : a.type == "bf16" ? "BF16" : "F32";
    // The folder is written whole beside --out, then its files are moved in: an export that
    // fails (a full disk) leaves --out as it was, the model it held still loading.
    namespace fs = std::filesystem;
    fs::path out = fs::absolute(a.out).lexically_normal();
    if (!out.has_filename()) out = out.parent_path();
    const fs::path staging = out.parent_path() / ("." + out.filename().string() + ".export-" +
                                                  std::to_string(::getpid()));
    fs::create_directories(out.parent_path(), ec);
    if (ec) throw UserError("--out " + a.out + ": cannot create (" + ec.message() + ")");
    try {
      fs::remove_all(staging, ec);
      write_hf_folder(staging.string(), m.config, m.model->parameters(), *m.tokenizer, dtype, read);
      fs::create_directories(out, ec);
      if (ec) throw UserError("--out " + a.out + ": cannot create (" + ec.message() + ")");
      for (const auto& entry : fs::directory_iterator(staging)) {
        fs::rename(entry.path(), out / entry.path().filename(), ec);
        if (ec)
          throw UserError("--out " + a.out + ": cannot move " + entry.path().string() +
                          " into it (" + ec.message() + ")");
      }
      fs::remove(staging, ec);
    } catch (...) {
      fs::remove_all(staging, ec);
      throw;
    }
    std::printf("wrote %s: a Hugging Face folder of %s, %lld parameters, %s\n", a.out.c_str(),
                m.source.c_str(), static_cast<long long>(parameter_count(m.config)), dtype.c_str());
    return 0;
  }
  const GgmlType written =
      write_gguf(a.out, m.config, m.model->parameters(), m.tokenizer->to_vocabulary(), options);
  if (written != options.type)
    std::fprintf(stderr,
                 "cputrain: warning: rows are not whole blocks of 32, so the matrices are f16, "
                 "not q8_0\n");
  std::printf("wrote %s: %s, %lld parameters, matrices %s\n", a.out.c_str(), m.source.c_str(),
              static_cast<long long>(parameter_count(m.config)),
              ggml_type_name(static_cast<uint32_t>(written)).c_str());
  return 0;
}

}  // namespace cputrain
