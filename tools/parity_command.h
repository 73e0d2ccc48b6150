// `cputrain parity`: does bf16 training track fp32, and does gradient accumulation equal one
// big batch? From one init and one sequence of batches it trains the same steps in fp32, in
// bf16, and in fp32 with the global batch split into micro-batches, and compares the losses.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "tools/train_command.h"

namespace cputrain {

struct ParityArgs {
  TrainArgs train;                      // preset, corpus, out, steps, batch, ctx, lr, seed, ...
  std::vector<int64_t> accum = {2, 4};  // the global batch split into batch/a x a, each a
  double tol_bf16 = 0.02;               // nats, |final bf16 - final fp32|
  double tol_accum = 1e-4;              // nats, |final split - final fp32|
  bool json = false;
};

// What one variant did at each step.
struct ParityCurve {
  std::string name;
  DType dtype = DType::F32;
  int64_t batch = 0;
  int64_t accum = 1;
  std::vector<double> loss;
  std::vector<double> grad_norm;
};

void add_parity_flags(CLI::App& app, ParityArgs& args);
// 0 when every difference is within its tolerance, 3 when one is not.
int run_parity(const ParityArgs& args);

}  // namespace cputrain
