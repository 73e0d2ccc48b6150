// A model configuration as JSON: the one form a run's config.json ("model") and `inspect --json`
// hold it in, and its one-line description for people.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "models/model_config.h"

namespace cputrain {

// A float as the shortest decimal that reads back as the same float (0.9f is written 0.9, not
// 0.8999999761581421): how config.json files hold floats.
double shortest_decimal(float f);

// Every field of the configuration: its architecture and the parts its description lets vary
// (biases, tied head, RoPE pairing, scaling and layers without RoPE), and its parameter count.
nlohmann::json model_config_json(const ModelConfig& config);
// The configuration model_config_json wrote; a UserError naming `where` and the field for a
// value of another type, an architecture or RoPE scaling type cputrain does not know, or parts
// its architecture does not have. Configurations written before a field existed read as llama
// models of plain multi-head attention, adjacent pairs, untied.
ModelConfig model_config_from_json(const nlohmann::json& model, const std::string& where);

// "RoPE half-split pairs, theta 1e+06, llama3 scaling (factor 8, original ctx 8192), none in
// layers 3, 7; RMSNorm eps 1e-06; q/k norms; tied embeddings".
std::string describe_parts(const ModelConfig& config);

}  // namespace cputrain
