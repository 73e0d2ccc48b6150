// `cputrain sample`: generate text from a run directory's saved model or a model file.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "tools/train_command.h"

namespace cputrain {

struct SampleArgs {
  std::string run;    // a run directory (--run), or
  std::string model;  // a run directory or a GGUF file (--model)
  int64_t ctx = 0;    // the context a model file is given (0: its own, at most 4096)
  std::string prompt;
  std::string adapter;  // a LoRA adapter file applied to the model (--adapter)
  std::string weights;  // empty: <run>/model.bin, else the newest checkpoint
  int64_t max_tokens = 200;
  double temperature = 0.8;
  int64_t top_k = 40;
  double top_p = 1.0;
  uint64_t seed = 1;
  int64_t n = 1;                  // continuations of the prompt, decoded together (--n)
  std::vector<std::string> stop;  // each continuation ends before the first of these (--stop)
  int threads = 0;
  bool stats = false;  // load time and tokens/s on stderr
  KernelArgs kernels;
};

void add_sample_flags(CLI::App& app, SampleArgs& args);
int run_sample(const SampleArgs& args);

}  // namespace cputrain
