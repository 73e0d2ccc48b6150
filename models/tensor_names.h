// How other formats name and lay out DecoderModel's parameters: llama.cpp's GGUF names and Hugging
// Face's, the order of q and k rows each format's RoPE expects, and a shape as messages print it.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "models/model_config.h"

namespace cputrain {

class ParameterSet;
struct Architecture;
struct ParameterInfo;

enum class TensorNaming { Gguf, HuggingFace };

// "layers.0.attention.wq.weight" -> "blk.0.attn_q.weight" (GGUF) or
// "model.layers.0.self_attn.q_proj.weight" (Hugging Face; in a model of `arch`, its own names
// where it has them: phi2's "model.layers.0.self_attn.dense.weight" for wo); a bias as its
// weight with ".bias"; an adapter's "layers.0.attention.wq.lora_a" -> "blk.0.attn_q.weight.lora_a"
// (llama.cpp's LoRA GGUF) or "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
// (PEFT); a name it does not know, unchanged.
std::string tensor_name(const std::string& parameter, TensorNaming naming,
                        const Architecture& arch);

// How a parameter's values are read (index, out): ParameterSet::read_values where null, else
// another reading of them (lora.h merged_values: the adapters merged into their projections).
using ValueReader = std::function<void(int index, float* values)>;

// The FP32 values of parameter `index` of a model of `config` (as `read` reads them), with the rows
// of wq and wk (and their biases, and the B of their adapters) in the pairing `pairs` wants:
// llama.cpp's llama architecture rotates adjacent pairs (2j, 2j+1), Hugging Face's rotate_half the
// pairs (j, j + D/2). A model computing with one pairing and the other's rows reordered computes
// the same attention. An RMSNorm's gains as the file wants them: less 1 where `norm_plus_one`
// (Gemma's Hugging Face files), whole where not, whichever way the model holds them
// (ModelConfig::norm_plus_one).
// With `grouped`, Gated DeltaNet's value heads in Hugging Face's order (reorder_value_heads).
std::vector<float> parameter_values(const ParameterSet& params, int index,
                                    const ModelConfig& config, RopePairs pairs,
                                    bool norm_plus_one = false, bool grouped = false,
                                    const ValueReader& read = nullptr);

// Gated DeltaNet's value heads (of v, z, beta's and a's rows, A and dt_bias, v's convolution,
// the output projection's columns, and their adapters' rows or columns) from the model's order,
// tiled over the key heads they read as llama.cpp holds them (k0v0, k1v0, k0v1, k1v1), to Hugging
// Face's, grouped by key head (k0v0, k0v1, k1v0, k1v1); back where `to_grouped` is false.
// Nothing for another parameter.
void reorder_value_heads(std::vector<float>& values, const ParameterInfo& info,
                         const ModelConfig& config, bool to_grouped);
// Whether reorder_value_heads moves anything of parameter `info` (value heads it holds, more
// value heads than key heads).
bool value_heads_reordered(const ParameterInfo& info, const ModelConfig& config);

// The same reordering of values already read: `values` of parameter `info`, from the pairing
// `from` to `to`.
void reorder_qk_rows(std::vector<float>& values, const ParameterInfo& info,
                     const ModelConfig& config, RopePairs from, RopePairs to);

// Where a parameter of a model of `config` is in a file of `naming`: the tensor (`name`) and the
// rows of it that are the parameter's. A fused tensor of the architecture (models/architecture.h)
// holds several parameters one after another: q, k, v (and their adapters' B) in attn_qkv, gate
// and up in ffn_up; any other tensor is one parameter's whole.
struct TensorPart {
  std::string name;
  int64_t first_row = 0;
  int64_t rows = 0;         // the parameter's (its shape[0])
  int64_t tensor_rows = 0;  // the tensor's: its parts' together
  // The rows are each expert's (shape[1] of a mixture's (E, rows, cols) experts): the experts'
  // gate and up in one GGUF tensor (ModelConfig::experts_gate_up_fused).
  bool per_expert = false;
};
TensorPart tensor_part(const ParameterInfo& info, const ModelConfig& config, TensorNaming naming);

// The shape of the file tensor (of `naming`) holding parameter `info` at `part`, as the model
// orders dimensions (rows first): the parameter's, with the tensor's rows (a fused one's parts
// together); Hugging Face's Conv1d weight [channels, 1, taps].
std::vector<int64_t> file_tensor_shape(const ParameterInfo& info, const TensorPart& part,
                                       TensorNaming naming);

// Whether parameter `info`'s rows lie head by head between another's in its file tensor:
// Qwen3.5's attention q and output gate (and their adapters' B), each head's q rows then its
// gate's.
bool interleaved_part(const ParameterInfo& info, const ModelConfig& config);

// Parameter `info`'s values from those of its file tensor (`tensor`, all its rows, at `part`):
// its rows of a fused one, head by head where interleaved (file_tensor_values' inverse).
std::vector<float> part_values(const std::vector<float>& tensor, const ParameterInfo& info,
                               const TensorPart& part, const ModelConfig& config);

// The tensors of a file of `naming` holding the parameters of `params` (a model of `config`)
// that `which` takes: each once, in the order of its first parameter, with the indices of its
// parameters in row order.
struct FileTensor {
  std::string name;
  std::vector<int64_t> shape;  // [rows, ...] as the model holds a matrix
  std::vector<int> parts;
};
std::vector<FileTensor> file_tensors(const ParameterSet& params, const ModelConfig& config,
                                     TensorNaming naming,
                                     const std::function<bool(const ParameterInfo&)>& which);
// A file tensor's values: its parameters' (q and k rows in `pairs`, norm gains as
// `norm_plus_one` says: parameter_values) one after another.
std::vector<float> file_tensor_values(const ParameterSet& params, const FileTensor& tensor,
                                      const ModelConfig& config, RopePairs pairs,
                                      bool norm_plus_one, bool grouped = false,
                                      const ValueReader& read = nullptr);

// Whether parameter `name` is a norm's gains ("layers.0.ffn_norm.weight", "norm.weight").
bool is_norm_gain(const std::string& name);

// "[64, 172]".
std::string shape_text(const std::vector<int64_t>& dims);

}  // namespace cputrain
