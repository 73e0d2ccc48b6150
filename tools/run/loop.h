// The loop every command that trains runs, on every rank of a job alike: the steps, their
// metrics.jsonl lines and log lines, the progress line, validation, checkpoints and their
// cadence, the bad-step filter, profiling, stop signals and the ranks' agreement on each step.
// What differs between commands is the batch source (token windows of a corpus, packed rows of
// examples with targets, or of preference pairs), with the loss it computes, and what the run
// leaves at its end (model.bin, or the adapter files).
#pragma once

#include <spdlog/spdlog.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "engine/core/error.h"
#include "engine/dist/communicator.h"
#include "engine/train/trainer.h"
#include "models/memory_budget.h"
#include "tools/run/progress.h"
#include "tools/run/stop_signals.h"

namespace cputrain {

class ParameterSet;

// What a run trains on. Every rank of a job holds one alike.
class BatchSource {
 public:
  virtual ~BatchSource() = default;
  // Runs step `step` (1-based) on `trainer`.
  virtual StepResult step(Trainer& trainer, int64_t step) = 0;
  // Whether the run has validation data.
  virtual bool validates() const = 0;
  // The validation loss; every rank of a job calls it, and they share the work.
  virtual double validate(Trainer& trainer) = 0;
  // Adds what the source knows of step `step` to its metrics.jsonl line.
  virtual void describe(int64_t /*step*/, nlohmann::json& /*line*/) const {}
  // What the step's log line says beside its loss ("" nothing; else " | ..."): the source's own
  // figures of the step last run.
  virtual std::string note() const { return ""; }
  // The same of the last validation: its metrics.jsonl fields, and words for its log line.
  virtual void describe_validation(nlohmann::json& /*line*/) const {}
  virtual std::string validation_note() const { return ""; }
  // What validation measures: its words on the log line and its metrics.jsonl key.
  virtual const char* validation_label() const { return "val"; }
  virtual const char* validation_key() const { return "val_loss"; }
};

// A step that could not be made (a reward command that failed) before it changed anything: the
// loop saves a checkpoint of the weights as the step found them and stops with the message.
struct StepFailure : UserError {
  using UserError::UserError;
};

// What a run leaves once it has trained all its steps.
class RunOutput {
 public:
  virtual ~RunOutput() = default;
  // Writes the result (rank 0); the other ranks of a job call it too, for what is collective.
  virtual void write(bool lead) = 0;
};

// How the loop runs: cadences, limits and what it records.
struct LoopPlan {
  std::string dir;      // the run directory, which rank 0 writes
  std::string command;  // "train" or "finetune": named in the advice to resume
  int64_t first_step = 1;
  int64_t steps = 0;            // the step the run ends at
  int64_t save_every = 0;       // a checkpoint every N steps (0: at the end and on a stop only)
  int64_t keep = 3;             // checkpoints kept
  int64_t eval_every = 0;       // validation every N steps (0: after the last step only)
  bool validate_first = false;  // and before the first step of a run that begins
  int64_t log_every = 1;
  double spike = 0.0;                // BadStepFilter's
  std::string on_bad_step = "stop";  // or "skip"
  bool profile = false;
  TestHold hold;
  std::string config_json;  // the run's config.json, recorded in each checkpoint
  uint64_t data_fingerprint = 0;
  MemoryBudget budget;
  std::string last_checkpoint;  // the checkpoint resumed from, if any
  bool replacing = false;       // --overwrite: the old run is deleted after the first step
  int64_t positions = 0;        // positions a step moves over the job, for each rank's tokens/s
  // MFU: the model's FLOPs per token trained and the peak to measure them against (0: none).
  double flops_per_token = 0.0;
  double peak_gflops = 0.0;
  std::function<double()> measure_peak;  // the peak measured again
  std::function<void(int64_t)> sample;   // a sample printed after step N (train --sample-every)
  int64_t sample_every = 0;
};

// What a rank runs the loop with: the log and console of rank 0 (the other ranks have neither).
struct LoopIo {
  std::shared_ptr<spdlog::logger> log;
  std::shared_ptr<ProgressSink> console;
};

// Trains steps plan.first_step .. plan.steps. Returns 0 once the output is written (every rank
// has ended the job), or 128 + the signal after a stop signal to any rank, with the step's
// checkpoint saved; throws a UserError on a bad step under on_bad_step "stop" (a QuietExit on
// ranks but 0, which says why).
int run_loop(const LoopPlan& plan, Trainer& trainer, const ParameterSet& params,
             BatchSource& source, RunOutput& output, const Communicator& comm, const LoopIo& io);

}  // namespace cputrain
