// The flags of every command that trains (train, finetune), each declared once with one help
// text, and the rules they share: which kernels run, the precision `--dtype auto` chooses and the
// memory a run may use. budget and parity take the same declarations for the flags they share.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/tensor.h"
#include "models/model_config.h"

namespace cputrain {

// Which kernels run (kernels/cpu/dispatch.h): flags every command that computes takes.
struct KernelArgs {
  std::string gemm;                 // --gemm NAME: as --kernel gemm=NAME
  std::vector<std::string> kernel;  // --kernel FAMILY=NAME, repeatable
  std::string isa;                  // --isa LEVEL: the highest ISA level any kernel may use
};
void add_kernel_flags(CLI::App& app, KernelArgs& args);
// Applies the flags and makes every kernel family choose now; a UserError naming the flag or
// variable for a name this CPU cannot run, a malformed --kernel or a bad CPUTRAIN_* variable.
// With `tuned`, the GEMM's blocking is the one `cputrain tune` cached for this CPU, if any.
void select_kernels(const KernelArgs& args, bool tuned = true);
// What select_kernels found of the GEMM's blocking: tuned for this CPU (`cputrain tune`, and
// the file) or the defaults from its caches.
const std::string& gemm_blocking();

// The preset --preset `name` names; a UserError listing the presets for any other name.
Preset preset_flag(const std::string& name);

// --dtype: "bf16" or "fp32" as given; "auto" (or empty) chooses bf16 where the selected GEMM has
// bf16 instructions and fp32 elsewhere (bf16 emulated in software is slower than fp32), with the
// reason in *why. A UserError for anything else.
DType choose_dtype(const std::string& flag, std::string* why);
// --mem-limit in bytes (each rank's), or when it is 0 the memory available to this process: the
// anonymous memory it holds now and MemAvailable (which counts the page cache, a mapped model
// file's pages among it), shared among a job's ranks on this machine.
int64_t memory_limit_bytes(double mem_limit_gib);

// The flags train and finetune share. A command's own defaults are set by its arguments' type
// (TrainArgs, FinetuneArgs); -1 (or empty) means "the command's default, worked out".
struct RunFlags {
  std::string out;     // the run directory
  std::string resume;  // --resume RUN (empty with a bare --resume: --out)
  bool overwrite = false;
  int64_t steps = -1;
  int64_t batch = -1;
  int64_t accum = -1;
  int64_t ctx = -1;
  double lr = -1.0;
  double weight_decay = 0.1;
  uint64_t seed = 1;
  int threads = 0;
  bool profile = false;
  int64_t eval_every = -1;
  int64_t save_every = -1;
  int64_t keep = 3;
  int64_t log_every = 1;
  double spike = 0.0;                // a loss above spike x the mean of the last 20 is bad; 0: off
  std::string on_bad_step = "stop";  // a non-finite loss or gradient, or a spike: stop or skip
  double mem_limit_gib = 0.0;        // GiB the run (each rank of a job) may use; 0: available
  double rank_timeout = 600;         // a job's rank waits this long for the others (0: forever)
  std::string offload;               // --offload DIR: masters and AdamW's state in files there
  std::string dtype = "auto";        // auto, bf16 or fp32
  std::string checkpoint = "none";   // gradient checkpointing: none, mlp, layer (auto: train)
  KernelArgs kernels;
  std::vector<std::string> given;  // the flags on the command line, as add_run_flags saw them

  // Whether `flag` ("--seed") was on the command line.
  bool was_given(std::string_view flag) const;
  // Whether the run continues one (--resume, with or without its directory).
  bool resuming() const { return was_given("--resume"); }
  // The run directory: --resume RUN, or --out; a UserError where they name two, or none.
  std::string run_dir() const;
};

// The commands that train: their defaults differ, and so does how the help reads them.
enum class RunCommand { Train, Finetune };

// Declares the shared flags on `app`, bound to `flags`, and records the flags given.
void add_run_flags(CLI::App& app, RunFlags& flags, RunCommand command);
// The ones budget and parity share: --threads and the kernel flags; --dtype, --checkpoint.
void add_threads_flag(CLI::App& app, int& threads);
void add_dtype_flag(CLI::App& app, std::string& dtype);
void add_checkpoint_flag(CLI::App& app, std::string& checkpoint,
                         const std::vector<std::string>& choices);
void add_memory_flags(CLI::App& app, double& mem_limit_gib, std::string& offload);

}  // namespace cputrain
