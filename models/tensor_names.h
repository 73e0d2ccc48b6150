// How other formats name and lay out LlamaModel's parameters: llama.cpp's GGUF names and Hugging
// Face's, the order of q and k rows each format's RoPE expects, and a shape as messages print it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "models/llama_config.h"

namespace cputrain {

class ParameterSet;
struct ParameterInfo;

enum class TensorNaming { Gguf, HuggingFace };

// "layers.0.attention.wq.weight" -> "blk.0.attn_q.weight" (GGUF) or
// "model.layers.0.self_attn.q_proj.weight" (Hugging Face); an adapter's
// "layers.0.attention.wq.lora_a" -> "blk.0.attn_q.weight.lora_a" (llama.cpp's LoRA GGUF) or
// "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" (PEFT); a name it does not
// know, unchanged.
std::string tensor_name(const std::string& parameter, TensorNaming naming);

// The FP32 values of parameter `index` of a model of `config`, with the rows of wq and wk (and
// their biases, and the B of their adapters) in the pairing `pairs` wants: llama.cpp's llama
// architecture rotates adjacent pairs (2j, 2j+1), Hugging Face's rotate_half the pairs (j, j +
// D/2). A model computing with one pairing and the other's rows reordered computes the same
// attention.
std::vector<float> parameter_values(const ParameterSet& params, int index,
                                    const LlamaConfig& config, RopePairs pairs);

// The same reordering of values already read: `values` of parameter `info`, from the pairing
// `from` to `to`.
void reorder_qk_rows(std::vector<float>& values, const ParameterInfo& info,
                     const LlamaConfig& config, RopePairs from, RopePairs to);

// "[64, 172]".
std::string shape_text(const std::vector<int64_t>& dims);

}  // namespace cputrain
