// A trained model on disk: the model configuration (JSON text) and the FP32 weights of a
// ParameterSet, with a checksum. Written atomically (temp file, fsync, rename).
//
// Layout (little-endian): "CTWEIGHT" | u32 version = 1 | u64 json bytes | json |
// u32 parameter count | per parameter: u32 name bytes, name, u32 ndim, ndim x u64 dims |
// u64 weight count | weight count x f32 | u64 FNV-1a of everything before it.
#pragma once

#include <string>

#include "engine/train/parameters.h"

namespace cputrain {

void save_weights(const std::string& path, const ParameterSet& params,
                  const std::string& config_json);

// The configuration JSON stored in the file at `path`, without reading the weights.
std::string read_weights_config(const std::string& path);

// Loads weights into `params`, whose names and shapes must match the file's. Any mismatch,
// truncation or checksum failure is a UserError naming the file. Refreshes the bf16 copies, if any.
void load_weights(const std::string& path, const ParameterSet& params);

}  // namespace cputrain
