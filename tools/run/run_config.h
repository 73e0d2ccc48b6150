// config.json of a run directory: the model configuration and the options a run was started
// with, so `sample` and later commands rebuild the same model.
#pragma once

#include <string>

#include "engine/train/trainer.h"
#include "models/model_config.h"

namespace cputrain {

struct RunConfig {
  std::string preset;
  std::string corpus;
  std::string init;  // the model the run began from (--model), absolute; empty: random weights
  ModelConfig model;
  TrainOptions train;
  int64_t steps = 0;       // the step the run ends at (train.lr.total_steps: where its decay ends)
  int64_t save_every = 0;  // a checkpoint every N steps (0: only at the end and on a signal)
  int64_t keep = 3;        // checkpoints kept
  int threads = 0;
  int ranks = 1;             // of the data-parallel job (mpirun -np N) it trains as
  DType dtype = DType::F32;  // F32 or BF16 (--dtype)
  Checkpointing checkpoint = Checkpointing::None;  // --checkpoint
  // --offload: the folder of the state files (masters, AdamW's m and v); empty: all in RAM. Where
  // the state is held, not what the run computes: a resumed run may change it.
  std::string offload;
};

std::string run_config_to_json(const RunConfig& config);
// UserError naming `path` when it is missing or malformed.
RunConfig read_run_config(const std::string& path);
// The same from config.json's text; errors name `path`.
RunConfig parse_run_config(const std::string& text, const std::string& path);
// What makes two configurations the same run, as a comparable string: all but the step the run
// ends at, the threads and the checkpoint saving, which a resumed run may change.
std::string run_identity(const std::string& config_json);

}  // namespace cputrain
