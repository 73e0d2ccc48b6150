#include "tools/export_command.h"

#include <cstdio>
#include <filesystem>

#include "engine/error.h"
#include "models/gguf_model.h"
#include "tools/model_source.h"

namespace cputrain {

void add_export_flags(CLI::App& app, ExportArgs& a) {
  auto* run = app.add_option("--run", a.run, "Run directory written by `cputrain train`");
  auto* model = app.add_option("--model", a.model, "A run directory or a GGUF file");
  run->excludes(model);
  model->excludes(run);
  app.add_option(
      "--weights", a.weights,
      "A run's model.bin or checkpoint (default: model.bin, else the newest checkpoint)");
  app.add_option("--out", a.out, "The GGUF file to write")->required();
  app.add_option("--type", a.type,
                 "Type of the matrices: f32, f16, bf16 or q8_0 (norms and biases stay f32)")
      ->capture_default_str()
      ->check(CLI::IsMember({"f32", "f16", "bf16", "q8_0"}));
  app.add_flag("--overwrite", a.overwrite, "Replace --out if it exists");
}

int run_export(const ExportArgs& a) {
  if (a.run.empty() && a.model.empty()) throw UserError("--run or --model is required");
  if (!a.out.ends_with(".gguf"))
    throw UserError("--out " + a.out + ": must end in .gguf (cputrain writes GGUF files)");
  if (std::filesystem::exists(a.out) && !a.overwrite)
    throw UserError("--out " + a.out + ": exists; choose another name or give --overwrite");
  const bool from_run = !a.run.empty();
  const std::string source = from_run ? a.run : a.model;
  LoadedModel m = load_model(source, from_run ? "--run" : "--model", a.weights, INT64_MAX);
  GgufExport options;
  options.type = a.type == "f16"    ? GgmlType::F16
                 : a.type == "bf16" ? GgmlType::BF16
                 : a.type == "q8_0" ? GgmlType::Q8_0
                                    : GgmlType::F32;
  options.name = std::filesystem::path(source).filename().string();
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
