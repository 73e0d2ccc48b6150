// Models from Hugging Face folders: config.json (a model_type of models/architecture.h) and the
// weights in model.safetensors or its shards. The tokenizer is models/hf_tokenizer.h's; writing a
// folder, models/hf_writer.h's.
#pragma once

#include <string>

#include "engine/io/safetensors_file.h"
#include "engine/train/parameters.h"
#include "models/model_config.h"

namespace cputrain {

class ParameterSet;
struct ParameterInfo;

// Whether `folder` holds a Hugging Face model (a config.json with a model_type).
bool is_hf_folder(const std::string& folder);

// The configuration of the model in `folder`: ctx its max_position_embeddings (its sliding
// window where it has one), at most `max_ctx`; RoPE on half-split pairs (Hugging Face's
// rotate_half). A UserError naming config.json for another model_type (naming the supported
// ones), a key the architecture does not read, a missing or inconsistent value, or what cputrain
// does not compute (a RoPE scaling type other than the architecture's, an activation other than
// SiLU, MLP biases, attention dropout).
// Every count of config.json is checked against the folder's tensors
// (models/file_hyperparameters.h) before anything is made from it, and a value of the wrong JSON
// type is a UserError naming its key.
ModelConfig hf_model_config(const std::string& folder, int64_t max_ctx);

// The folder's tensors as the model reads them. Of an image-and-text folder whose text model
// cputrain reads (Architecture::hf_multimodal_types: Qwen3.5's published checkpoints), the text
// model's under a text model's names (model.language_model. -> model.), the vision model's left
// out; a multi-token-prediction block (mtp.*) that config.json declares (mtp_num_hidden_layers)
// left out. `left_out` receives what was, for the
// line naming the model (" (its vision model and multi-token prediction, 1,234 tensors, left
// out)"), empty where nothing.
SafetensorsModel hf_weights(const std::string& folder, std::string* left_out = nullptr);
// The same, with the folder's tensors already opened.
ModelConfig hf_model_config(const std::string& folder, const SafetensorsModel& weights,
                            int64_t max_ctx);

// Checks, before anything is allocated for the model, what load_hf_weights checks: every
// parameter of a model of `config` (no adapters) has its tensor in the folder, of its shape and of
// a dtype cputrain reads, and every tensor has its place. A UserError naming the file and tensor
// otherwise.
void check_hf_weights(const SafetensorsModel& weights, const ModelConfig& config);

// Converts the folder's tensors into the model's parameters, checking each shape; a UserError
// naming the file and tensor for a missing, misshapen or unread-dtype one, or one the model has
// no place for.
void load_hf_weights(const SafetensorsModel& weights, const ParameterSet& params,
                     const ModelConfig& config);

// The values of `parameter` (of DecoderModel), where they can be read in place: a BF16 tensor of
// its shape (dtype BF16). Else dtype F32.
InPlaceWeight hf_in_place(const SafetensorsModel& weights, const ParameterInfo& parameter,
                          const ModelConfig& config);

}  // namespace cputrain
