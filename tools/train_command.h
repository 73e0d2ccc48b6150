// `cputrain train`: prepare the data, build the model, train, evaluate, save, sample.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>

namespace cputrain {

// Flags as given; -1 (or empty) means "take the preset's value".
struct TrainArgs {
  std::string preset = "mini";
  std::string corpus = "/usr/share/games/fortunes";
  std::string out;
  int64_t steps = -1;
  int64_t batch = -1;
  int64_t accum = -1;
  int64_t ctx = -1;
  int64_t vocab = -1;
  int64_t d_model = -1;
  int64_t layers = -1;
  int64_t heads = -1;
  int64_t ffn = -1;
  double lr = -1.0;
  int64_t warmup = -1;
  double weight_decay = 0.1;
  double grad_clip = 1.0;
  uint64_t seed = 1;
  int threads = 0;
  int64_t eval_every = -1;
  int64_t eval_windows = 32;
  int64_t sample_every = 0;
  int64_t sample_tokens = 80;
  int64_t log_every = 1;
  std::string gemm;
};

void add_train_flags(CLI::App& app, TrainArgs& args);
// Applies --gemm (empty: keep the default); a UserError for a name this CPU cannot run, or a bad
// CPUTRAIN_GEMM.
void select_gemm_backend(const std::string& flag);
int run_train(const TrainArgs& args);

}  // namespace cputrain
