// The stages of a training run, each doing one thing: the log, the data, the memory plan, the
// time a step will take, resuming from a checkpoint and saving one. `cputrain train` runs them
// in order (tools/train_command.cpp), after open_run_directory (tools/run/run_dir.h); a command
// that trains otherwise reuses them.
#pragma once

#include <spdlog/spdlog.h>

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "engine/core/memory.h"
#include "engine/data/data_pipeline.h"
#include "engine/train/checkpoint_file.h"
#include "engine/train/trainer.h"
#include "models/memory_budget.h"
#include "tools/run/progress.h"
#include "tools/run/run_config.h"

namespace cputrain {

class AdamW;
class ParameterSet;

// The logger "cputrain", to `console` and appended to <dir>/train.log, made the default.
std::shared_ptr<spdlog::logger> open_run_log(const std::string& dir,
                                             std::shared_ptr<ProgressSink> console);

// The run's tokenizer and token cache (prepare_data), with the run directory and the folders of
// other runs inside the corpus passed over, what was passed over logged, the vocabulary the
// tokenizer gave set in config.model.vocab (a warning where it is smaller than asked), and a
// UserError where the training split is shorter than one window. `expect`: a resumed run's
// data fingerprint, `name` how messages name the corpus. Progress on the console's status line.
PreparedData prepare_run_data(RunConfig& config, const std::string& dir, ProgressSink& console,
                              std::optional<uint64_t> expect, const std::string& name);

// What can be known of the memory before the data is prepared: the budget with no corpus
// tokens, the smallest vocabulary a tokenizer trained on the corpus may give (the model's where
// `vocab_known`: a run from a model or resumed) and (where `checkpoint_flag` is "auto")
// checkpointing. Where
// even that exceeds `available`, the table and levers are logged and a UserError names the
// figures, so a run that cannot fit is refused before minutes of tokenizing.
void check_memory_floor(const RunConfig& config, bool vocab_known,
                        const std::string& checkpoint_flag, int64_t available, spdlog::logger& log);

// The budget with the data: per-layer checkpointing where `checkpoint_flag` is "auto" and it is
// needed to fit (config.checkpoint set), the table logged, and a UserError with the levers
// logged where it does not fit.
MemoryBudget plan_memory(RunConfig& config, const std::string& checkpoint_flag,
                         int64_t corpus_tokens, int64_t eval_windows, int64_t available,
                         spdlog::logger& log);

// The seconds one optimizer step needs at `peak_gflops`: a lower bound, the real step being
// slower. A warning is logged where a step needs over 30 s, or over 2 s with attention over 3/4
// of its FLOPs (a --ctx far beyond what the model's width makes sensible).
double step_seconds_at_peak(const RunConfig& config, double peak_gflops);
void warn_of_slow_steps(const RunConfig& config, double peak_gflops, spdlog::logger& log);

// The newest checkpoint of a run that reads back whole; damaged ones are skipped, each with one
// warning. A UserError when there is none, or when it was made by another configuration than
// `config_json` (the run's config.json; the step count, threads and saving may differ).
struct ResumePoint {
  std::string path;
  CheckpointInfo info;
};
ResumePoint find_resume_point(const std::string& dir, const std::string& config_json,
                              spdlog::logger& log);

// Writes <dir>/checkpoints/step-N.ckpt and keeps the newest `keep` up to it; one past it (which
// a resume passed over as unreadable) is renamed to <name>.damaged. Returns its path.
std::string save_training_checkpoint(const std::string& dir, int64_t step,
                                     const ParameterSet& params, const AdamW& adamw,
                                     uint64_t data_fingerprint, const std::string& config_json,
                                     int64_t keep, spdlog::logger& log);

// Which steps are bad: a non-finite loss or gradient norm, or (with `spike` > 0) a loss above
// spike x the mean of the last 20 accepted steps. The trainer's step filter.
class BadStepFilter {
 public:
  explicit BadStepFilter(double spike) : spike_(spike) {}
  // Whether the step may be applied; when not, reason() says why.
  bool accept(const StepResult& r);
  const std::string& reason() const { return reason_; }

 private:
  double spike_;
  std::vector<double> recent_;  // losses of the last accepted steps
  std::string reason_;
};

// One line of metrics.jsonl: the step's figures, memory against the budget per category, and
// the model's GFLOP/s and MFU (where measured).
nlohmann::json step_record(int64_t step, const StepResult& r, const ProcessMemory& mem,
                           const MemoryBudget& budget, double model_gflops,
                           std::optional<double> mfu);

// --profile: the table of the profiled steps in the log, and <dir>/profile.json; nothing when no
// step was profiled.
void write_profile(const std::string& dir, int64_t steps, double seconds, spdlog::logger& log);

// Keeps the lines of a metrics.jsonl up to `step`.
void truncate_metrics(const std::string& path, int64_t step);

}  // namespace cputrain
