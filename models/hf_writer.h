// Hugging Face folders written: a model Transformers loads, and a LoRA adapter as PEFT saves it.
#pragma once

#include <string>

#include "engine/train/parameters.h"
#include "models/lora.h"
#include "models/model_config.h"
#include "models/tensor_names.h"

namespace cputrain {

class Tokenizer;

// Writes the model (`config`, its parameters) and its tokenizer as a Hugging Face folder
// Transformers loads: config.json (the model_type and class of the config's architecture, its
// RoPE scaling and layers without RoPE), model.safetensors with every tensor in `dtype` ("F32",
// "F16" or "BF16"; q and k rows in rotate-half order, reordered from adjacent pairs where the model
// uses those), and the tokenizer: cputrain's own SentencePiece model as tokenizer.model, a model
// file's vocabulary as tokenizer.json; tokenizer_config.json with the special tokens and the chat
// template. `folder` is created; files of the same names in it are replaced.
// With `read`, the parameters' values as it reads them, and their adapters left out (a reader
// that merges them: lora.h merged_values).
void write_hf_folder(const std::string& folder, const ModelConfig& config,
                     const ParameterSet& params, const Tokenizer& tokenizer,
                     const std::string& dtype, const ValueReader& read = nullptr);

// The model's adapters as PEFT saves them: adapter_model.safetensors (F32, PEFT's module names,
// B's q and k rows in rotate-half order) and adapter_config.json (LORA, r, lora_alpha, the
// target modules, `base` as base_model_name_or_path). `folder` is created.
void write_peft_adapter(const std::string& folder, const ModelConfig& config,
                        const ParameterSet& params, const LoraConfig& lora,
                        const std::string& base);

}  // namespace cputrain
