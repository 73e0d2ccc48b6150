// Where a command reads a model from (--model PATH): a cputrain run directory, a GGUF file, or a
// Hugging Face folder.
// The model, its tokenizer and where they came from, ready to compute.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "engine/text/tokenizer.h"
#include "models/decoder.h"
#include "models/model_config.h"
#include "models/tensor_names.h"

namespace cputrain {

struct LoadedModel {
  ModelConfig config;
  std::unique_ptr<DecoderModel> model;
  std::unique_ptr<Tokenizer> tokenizer;
  std::string source;         // "GGUF llama, stories260K.gguf" or the run's weights file
  bool bf16_weights = false;  // held as bf16 alone (load_model's bf16_when_exact)
  // The context the model file declares, before load_model's max_ctx capped config.ctx (what an
  // export writes).
  int64_t declared_ctx = 0;
  // What the model file's index (a GGUF file's metadata, a vocabulary of 150k tokens and merges
  // among it) and the tokenizer hold on the heap (GgufFile::heap_bytes, Tokenizer::heap_bytes):
  // a memory budget's host_bytes.
  int64_t host_bytes = 0;
  // How the file the weights came from names its tensors (none for a run's own files), and the
  // LoRA adapter file applied (a fine-tune's adapter.gguf or --adapter), which names them as
  // llama.cpp's GGUF does: what a message about a parameter says.
  std::optional<TensorNaming> naming;
  std::string adapter_file;
  // The model's name as llama.cpp's converter writes general.name (which llama.cpp reads as a
  // hint of the model: a name with "phi3" in it sets Phi-3's token attributes), what an export or
  // a fine-tune's result is named: a GGUF file's own (none where it has none); a Hugging Face
  // folder's hub id (config.json's _name_or_path, where it is one) or else the folder's name, as
  // a title ("Qwen2.5 0.5B Instruct"); a training run's directory's, as a title; a fine-tune's,
  // its base's.
  std::string name;
};

// The context a model file is given where it declares a longer one and no --ctx says otherwise.
constexpr int64_t kDefaultImportCtx = 4096;

// `path` (named by `flag` in messages) as a run directory (its config.json, tokenizer.model and
// `weights`, else model.bin, else the newest checkpoint), a Hugging Face folder (config.json
// with a model_type, safetensors, tokenizer) or a GGUF file. `max_ctx` caps a model
// file's context. A UserError for anything else, naming the flag and path.
// With `bf16_when_exact`, a model file whose matrices are all BF16 is held as those bf16 values
// alone (frozen, computed in bf16: half the memory and the memory traffic of FP32), since no
// rounding is lost; any other is held in FP32.
// With `adapter`, a LoRA adapter file (llama.cpp's format) applied to the model.
LoadedModel load_model(const std::string& path, const std::string& flag, const std::string& weights,
                       int64_t max_ctx, bool bf16_when_exact = false,
                       const std::string& adapter = "");
// The same, built with `options` (a fine-tune's adapters, precision and frozen parameters) from
// a GGUF file or a Hugging Face folder; the frozen weights of a bf16 model that the file holds as
// BF16 are read in place, the others converted once.
LoadedModel load_model_to_train(const std::string& path, const std::string& flag, int64_t max_ctx,
                                const ModelOptions& options);

// Where the model file at `path` holds each parameter (of a DecoderModel of `config`) so that it
// can be read in place (ModelOptions::in_place), the file kept open by the function; null for a
// run directory. What the memory budget of a job on the file measures with.
std::function<InPlaceWeight(const ParameterInfo&)> in_place_weights(const std::string& path,
                                                                    const std::string& flag,
                                                                    const ModelConfig& config);

// A UserError where the loaded model holds a NaN or an infinity, naming `flag` and `path` (or
// the adapter file, for an adapter's parameter) and the parameter: what sample, eval and export
// refuse to compute with or write.
void check_finite_weights(const LoadedModel& m, const std::string& path, const std::string& flag,
                          const std::string& adapter = "");

// Whether the file at `path` begins as a GGUF file does.
bool starts_with_gguf_magic(const std::string& path);

// Whether `path` is the run directory of a LoRA fine-tune (`cputrain finetune`): load_model reads
// it as its base with its adapter (adapter.gguf, or a checkpoint's adapters); a fine-tune of
// every parameter reads as the model it trained (model.gguf, or a checkpoint's weights).
bool is_lora_finetune(const std::string& path);
// Of a fine-tune's run directory, a line saying what it holds ("a LoRA fine-tune (rank 16, alpha
// 32 on q,k,v,o,gate,up,down) of BASE: adapter.gguf"); nothing for any other path.
std::optional<std::string> describe_finetune_run(const std::string& path);

// What load_model's file index and tokenizer of the model at `path` hold on the heap
// (LoadedModel::host_bytes), without its weights: the budget command's measure of them.
int64_t model_host_bytes(const std::string& path, const std::string& flag);

// The configuration alone of the model at `path` (as load_model reads it), its context at most
// `max_ctx`.
ModelConfig load_model_config(const std::string& path, const std::string& flag, int64_t max_ctx);
// The weights of the model at `path` into `params` (a model of load_model_config's shape).
void load_model_weights(const std::string& path, const std::string& flag,
                        const ParameterSet& params);

// --run DIR and --model PATH, one or the other: the flags of every command that reads a model.
void add_model_source_flags(CLI::App& app, std::string& run, std::string& model);
// The one given, as (path, flag); a UserError where neither is, or --run is not a directory.
std::pair<std::string, std::string> model_source(const std::string& run, const std::string& model);

// The tokenizer alone of `path`: a run directory's tokenizer.model, or a GGUF file's vocabulary
// (a vocabulary-only file will do). A UserError naming the flag and path otherwise.
Tokenizer load_tokenizer(const std::string& path, const std::string& flag);

}  // namespace cputrain
