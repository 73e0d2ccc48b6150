// `cputrain sample`: generate text from a run directory's saved model.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>

#include "tools/train_command.h"

namespace cputrain {

struct SampleArgs {
  std::string run;
  std::string prompt;
  std::string weights;  // empty: <run>/model.bin, else the newest checkpoint
  int64_t max_tokens = 200;
  double temperature = 0.8;
  int64_t top_k = 40;
  double top_p = 1.0;
  uint64_t seed = 1;
  int threads = 0;
  KernelArgs kernels;
};

void add_sample_flags(CLI::App& app, SampleArgs& args);
int run_sample(const SampleArgs& args);

}  // namespace cputrain
