// A training checkpoint: what `cputrain train --resume` needs to continue a run so that it is
// bitwise the run that never stopped. The FP32 weights of the trainable parameters (laid out as
// their gradients; with a fingerprint of the frozen ones), AdamW's m, v and step count, the step
// reached (which fixes the learning-rate schedule and, with the seed, every later batch: the
// sampler keeps no other state), the run configuration, and the fingerprint of the data
// (tokenizer and token cache) it trained on. Written atomically (AtomicFileWriter).
//
// Layout (little-endian): "CTCKPT01" | u32 version = 1 | u64 json bytes | json | u64 n |
// n f32 weights | n f32 m | n f32 v | u64 FNV-1a of everything before it. The JSON holds
// "step", "adamw_step", "data_fingerprint" (hex), "config" (the run's config.json) and, where
// parameters are frozen, "frozen_fingerprint" (hex).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "engine/train/adamw.h"
#include "engine/train/parameters.h"

namespace cputrain {

struct CheckpointInfo {
  int64_t step = 0;
  int64_t adamw_step = 0;
  uint64_t data_fingerprint = 0;
  std::string config_json;
  // ParameterSet::frozen_fingerprint of what it was trained on; 0 where nothing was frozen.
  uint64_t frozen_fingerprint = 0;
};

void save_checkpoint(const std::string& path, const ParameterSet& params, const AdamW& adamw,
                     const CheckpointInfo& info);

// Checks magic, version and checksum before anything else, then the header. A file that is
// not a checkpoint, is truncated, corrupt or of another version is one UserError naming it.
CheckpointInfo read_checkpoint_info(const std::string& path);

// read_checkpoint_info, then the weights into `params` and, unless `adamw` is null, AdamW's
// state into it; both must be of the checkpoint's size, and the frozen parameters those it
// was trained with. Refreshes the bf16 copies. Nothing is
// written into them unless the whole file is valid.
CheckpointInfo load_checkpoint(const std::string& path, const ParameterSet& params, AdamW* adamw);

// On a rank other than 0 of a job whose AdamW is sharded (engine/train/adamw.h): its part in rank
// 0's save_checkpoint (saving: its shard of the sharded masters, m and v sent to rank 0) or
// load_checkpoint (its shard taken from what rank 0 reads), called at the same time as rank 0's.
void share_checkpoint_state(const ParameterSet& params, AdamW& adamw, bool saving);

// A run directory's checkpoints: <run>/checkpoints/step-NNNNNNNN.ckpt.
std::string checkpoint_dir(const std::string& run_dir);
std::string checkpoint_path(const std::string& run_dir, int64_t step);
// (step, path) of each checkpoint file in the run directory, oldest first; none if the folder
// is missing.
std::vector<std::pair<int64_t, std::string>> list_checkpoints(const std::string& run_dir);

}  // namespace cputrain
