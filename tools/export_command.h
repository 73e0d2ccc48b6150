// `cputrain export`: a run or a model file, written as a GGUF file llama.cpp runs or a Hugging
// Face folder Transformers loads.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

namespace cputrain {

struct ExportArgs {
  std::string run;      // a run directory (--run), or
  std::string model;    // a run directory or a GGUF file (--model)
  std::string weights;  // a run's model.bin or checkpoint (default: model.bin, else the newest)
  std::string out;      // FILE.gguf, or a folder
  std::string adapter;  // a LoRA adapter file (--adapter), merged into the model (--merge)
  bool merge = false;
  std::string type = "f32";
  bool overwrite = false;
};

void add_export_flags(CLI::App& app, ExportArgs& args);
int run_export(const ExportArgs& args);

}  // namespace cputrain
