// `cputrain train`: prepare the data, build the model, train, evaluate, save, sample.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "tools/run_config.h"

namespace cputrain {

// Which kernels run (kernels/dispatch.h): flags every command that computes takes.
struct KernelArgs {
  std::string gemm;                 // --gemm NAME: as --kernel gemm=NAME
  std::vector<std::string> kernel;  // --kernel FAMILY=NAME, repeatable
  std::string isa;                  // --isa LEVEL: the highest ISA level any kernel may use
};
void add_kernel_flags(CLI::App& app, KernelArgs& args);
// Applies the flags and makes every kernel family choose now; a UserError naming the flag or
// variable for a name this CPU cannot run, a malformed --kernel or a bad CPUTRAIN_* variable.
void select_kernels(const KernelArgs& args);

// Flags as given; -1 (or empty) means "take the preset's value".
struct TrainArgs {
  std::string preset = "mini";
  std::string corpus = "/usr/share/games/fortunes";
  std::string out;
  std::string model;  // start from this model (a GGUF file, a Hugging Face folder or a run)
  int64_t steps = -1;
  int64_t batch = -1;
  int64_t accum = -1;
  int64_t ctx = -1;
  int64_t vocab = -1;
  int64_t d_model = -1;
  int64_t layers = -1;
  int64_t heads = -1;
  int64_t kv_heads = -1;        // -1: as many as --heads
  int64_t head_dim = -1;        // -1: d_model / heads
  double rope_theta = -1.0;     // -1: the preset's (10000)
  std::string rope_pairs;       // "adjacent", "half-split", or empty: the preset's
  bool qkv_bias = false;        // biases on the q, k and v projections
  bool tie_embeddings = false;  // the LM head is the embedding matrix
  int64_t ffn = -1;
  double lr = -1.0;
  int64_t warmup = -1;
  double weight_decay = 0.1;
  double grad_clip = 1.0;
  uint64_t seed = 1;
  int threads = 0;
  bool pin_threads = false;  // bind each OpenMP thread to one CPU
  bool profile = false;      // per-op timers over the steps after the first, printed at the end
  int64_t eval_every = -1;
  int64_t eval_windows = 32;
  int64_t sample_every = 0;
  int64_t sample_tokens = 80;
  int64_t log_every = 1;
  KernelArgs kernels;
  std::string dtype;                 // "bf16", "fp32", or empty: choose_dtype's default
  std::string resume;                // a run directory to continue from its latest checkpoint
  bool overwrite = false;            // replace a run already in --out
  int64_t save_every = -1;           // checkpoint every N steps; -1: steps / 10
  int64_t keep = 3;                  // checkpoints kept
  double mem_limit_gib = 0.0;        // GiB the run may use; 0: MemAvailable at start
  double rank_timeout = 600;         // a job's rank waits this long for the others (0: forever)
  std::string offload;               // --offload DIR: masters and AdamW's state in files there
  double spike = 0.0;                // a loss above spike x the mean of the last 20 is bad; 0: off
  std::string on_bad_step = "stop";  // a non-finite loss or gradient, or a spike: stop or skip
  std::string checkpoint = "auto";   // "layer", "none", or "auto": layer when none would not fit
  std::vector<std::string> given;    // the flags on the command line, as add_train_flags saw them
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

// --dtype: "bf16" or "fp32" as given; empty chooses bf16 where the selected GEMM has bf16
// instructions and fp32 elsewhere (bf16 emulated in software is slower than fp32), with the
// reason in *why. A UserError for anything else.
DType choose_dtype(const std::string& flag, std::string* why);
// --mem-limit in bytes (each rank's), or when it is 0 MemAvailable shared among the job's ranks on
// this machine.
int64_t memory_limit_bytes(double mem_limit_gib);
// "cpu: <features>; kernels: gemm amx, attention amx, ... (gemm available: ...)" for the
// start-up log.
std::string describe_compute();

}  // namespace cputrain
