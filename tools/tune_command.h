// `cputrain tune`: measures the GEMM blocking (kernels/gemm/gemm_tuning.h) that runs the products
// of a run fastest on this CPU and keeps it in the user's cache, per CPU model and thread count;
// the commands that compute read it back (load_gemm_tuning). The blocking never changes a
// result, so a tuned machine computes the bits an untuned one does.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>

#include "tools/run/run_flags.h"

namespace cputrain {

struct TuneArgs {
  std::string preset = "mega";
  std::string model;   // --model PATH: its shapes instead of a preset's
  int64_t tokens = 0;  // tokens of a micro-batch (0: the preset's batch x ctx, 2048 for a model)
  int threads = 0;     // 0: all
  std::string dtype = "auto";
  int64_t rounds = 5;      // timings of each candidate, taken in turn with the others
  double min_gain = 0.02;  // a value replaces the one before where it is this much faster
  bool show = false;
  bool reset = false;
  KernelArgs kernels;
};

void add_tune_flags(CLI::App& app, TuneArgs& args);
int run_tune(const TuneArgs& args);

}  // namespace cputrain
