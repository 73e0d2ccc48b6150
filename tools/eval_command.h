// `cputrain eval`: the loss and perplexity of a trained run on its validation split or on
// another corpus.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>

#include "tools/train_command.h"

namespace cputrain {

struct EvalArgs {
  std::string run;
  std::string model;       // a run directory or a GGUF file (--model), with --text
  std::string text;        // a text file whose perplexity is asked (--text)
  int64_t ctx = 0;         // tokens per window with --text (0: the model's context, at most 4096)
  bool per_token = false;  // each token's id and negative log-likelihood
  std::string corpus;      // empty: the run's validation split
  std::string adapter;     // a LoRA adapter file applied to the model (--adapter)
  std::string weights;     // empty: <run>/model.bin, else the newest checkpoint
  int64_t windows = 0;     // 0: every window
  int64_t batch = 8;
  int threads = 0;
  KernelArgs kernels;
  bool json = false;
};

void add_eval_flags(CLI::App& app, EvalArgs& args);
int run_eval(const EvalArgs& args);

}  // namespace cputrain
