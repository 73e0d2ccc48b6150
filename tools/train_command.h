// `cputrain train`: prepare the data, build the model, train, evaluate, save, sample.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "tools/run/run_config.h"
#include "tools/run/run_flags.h"

namespace cputrain {

// Flags as given; -1 (or empty) means "take the preset's value".
struct TrainArgs : RunFlags {
  TrainArgs() {
    checkpoint = "auto";
    weight_decay = 0.1;
  }
  std::string preset = "mini";
  std::string corpus = "/usr/share/games/fortunes";
  std::string model;  // start from this model (a GGUF file, a Hugging Face folder or a run)
  int64_t vocab = -1;
  int64_t d_model = -1;
  int64_t layers = -1;
  int64_t heads = -1;
  int64_t kv_heads = -1;        // -1: as many as --heads
  int64_t head_dim = -1;        // -1: d_model / heads
  double rope_theta = -1.0;     // -1: the preset's (10000)
  std::string arch = "llama";   // an architecture of models/architecture.h: its parts
  std::string rope_pairs;       // "adjacent", "half-split", or empty: the architecture's
  bool qkv_bias = false;        // biases on the q, k and v projections
  bool tie_embeddings = false;  // the LM head is the embedding matrix
  int64_t sliding_window = -1;  // -1: the architecture's (sliding-window layers only)
  int64_t ffn = -1;
  // A mixture of experts: how many, how many a token takes, each one's width; -1: the
  // architecture's (models/architecture.cpp with_architecture).
  int64_t experts = -1;
  int64_t experts_used = -1;
  int64_t expert_ffn = -1;
  int64_t warmup = -1;
  double grad_clip = 1.0;
  // A mixture of experts' router losses' coefficients (TrainOptions::moe_balance, moe_z); -1:
  // not given (the load-balancing loss at Qwen's 0.001 for a mixture, no z-loss).
  double moe_balance = -1.0;
  double moe_z = -1.0;
  bool pin_threads = false;  // bind each OpenMP thread to one CPU
  int64_t eval_windows = 32;
  int64_t sample_every = 0;
  int64_t sample_tokens = 80;
};

void add_train_flags(CLI::App& app, TrainArgs& args);
int run_train(const TrainArgs& args);

// The presets' values with the flags' overrides, validated; a UserError naming the flag.
RunConfig resolve_run_config(const TrainArgs& args);
// A model configuration's problem as one line in the flags' terms ("--d-model 100 is not a
// multiple of --heads 3").
std::string flag_message(const ConfigProblem& problem);
// Registers the flags that shape the model (width, depth, heads, GQA, RoPE, biases, tying).
void add_model_flags(CLI::App& app, TrainArgs& args);

// "cpu: <features>; kernels: gemm amx, attention amx, ... (gemm available: ...)" for the
// start-up log.
std::string describe_compute();

}  // namespace cputrain
