// Models from GGUF files: the architectures cputrain computes (models/architecture.h), their
// configuration from the file's metadata, and their weights converted into a model's parameters.
#pragma once

#include <string>

#include "engine/io/gguf_file.h"
#include "engine/text/vocab_tokenizer.h"
#include "engine/train/parameters.h"
#include "models/lora.h"
#include "models/model_config.h"
#include "models/tensor_names.h"

namespace cputrain {

class ParameterSet;
struct ParameterInfo;

// "llama, qwen2, qwen3, phi3, smollm3".
std::string gguf_supported_architectures();

// The configuration of the model in `file`. ctx is the file's context length, at most `max_ctx`
// (a model trained at 128k need not be given a 128k cache to sample from). A UserError naming the
// file for another architecture (naming it and the supported ones), a missing or inconsistent
// hyperparameter, a key of the architecture it does not read, or a feature cputrain does not
// compute (a RoPE scaling type, partial rotary). rope_freqs.weight is read as Llama 3's scaling
// where its factors are Llama 3's, else as the factors alone.
ModelConfig gguf_model_config(const GgufFile& file, int64_t max_ctx);

// What of the file the model of `config` leaves out, as llama.cpp leaves it out of its forward
// pass, for the line that names the model: " (blk.24, multi-token prediction, left out)"; empty
// where nothing.
std::string gguf_left_out(const GgufFile& file, const ModelConfig& config);

// Checks, before anything is allocated for the model, what load_gguf_weights checks: every
// parameter of a model of `config` (no adapters) has its tensor in the file, of its shape and of a
// type cputrain converts, and every tensor of the file has its place. A UserError naming the file
// and tensor otherwise.
void check_gguf_weights(const GgufFile& file, const ModelConfig& config);

// Converts every tensor of the file into the model's parameters (declared by DecoderModel for
// `config`; a fused tensor into its parts): dequantised to FP32, checked against the parameter's
// shape. A UserError naming the file and tensor for a missing, misshapen or unsupported-type
// tensor, or one the model has no place for.
void load_gguf_weights(const GgufFile& file, const ParameterSet& params, const ModelConfig& config);

// The values in `file` of `parameter` (of DecoderModel), where they can be read in place: a BF16
// tensor or one of a quantised type cputrain reads (ggml_quant_type), of the parameter's shape
// (or a whole number of rows of a fused one). Else dtype F32. (load_gguf_weights writes nothing
// into a parameter mapped so, and checks it as any other.)
InPlaceWeight gguf_in_place(const GgufFile& file, const ParameterInfo& parameter,
                            const ModelConfig& config);

// What `cputrain export` writes into a GGUF file.
struct GgufExport {
  // Of the matrices (norms and biases are always F32); Q4_K: Q4_K_M's mix of Q4_K and Q6_K.
  GgmlType type = GgmlType::F32;
  std::string name;  // general.name
  // How the parameters' values are read (null: ParameterSet::read_values); with one, the
  // parameters' adapters are left out (a reader that merges them: lora.h merged_values).
  ValueReader read;
};

// Writes the model (`config`, its parameters) and its tokenizer as a GGUF file llama.cpp runs:
// the config's architecture, its q and k rows in the pairing llama.cpp applies to it (which
// computes the same attention), every hyperparameter llama.cpp reads, RoPE scaling as
// rope_freqs.weight; the tokenizer as tokenizer.ggml.* (with its chat template, where it has one).
// Returns the matrices' type, which is F16 where Q8_0 was asked for rows that are not whole
// blocks of 32. The file is written one tensor at a time, each converted from the parameters as
// it is written: what it holds beside them is one tensor's values (a base read in place from its
// own file is exported in the memory its fine-tune takes).
GgmlType write_gguf(const std::string& path, const ModelConfig& config, const ParameterSet& params,
                    const Vocabulary& vocabulary, const GgufExport& options);

// The model's adapters (its .lora_a and .lora_b parameters, F32) as llama.cpp's LoRA adapter
// file: general.type adapter, adapter.type lora, adapter.lora.alpha, the base's architecture (B's
// q and k rows in the pairing its GGUF has), and each tensor named
// after its projection ("blk.0.attn_q.weight.lora_a"), for llama_adapter_lora_init.
// It records the base's fingerprint (models/lora.h) as cputrain.base_fingerprint.
void write_lora_gguf(const std::string& path, const ModelConfig& config, const ParameterSet& params,
                     double alpha, const std::string& name);

// The adapters a LoRA adapter file holds: its rank, alpha and targets. A UserError naming the
// file where it is no LoRA adapter or holds no adapter cputrain computes.
LoraConfig lora_gguf_config(const GgufFile& file);
// Reads the file's adapters into `params` (a model of `config` built with lora_gguf_config's
// adapters). A UserError naming the file where its architecture, a tensor's shape or the base's
// fingerprint is not the model's.
void load_lora_gguf(const GgufFile& file, const ModelConfig& config, const ParameterSet& params);

}  // namespace cputrain
