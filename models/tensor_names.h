// The names other formats give LlamaModel's parameters: llama.cpp's GGUF names and Hugging
// Face's, and a shape as messages print it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace cputrain {

enum class TensorNaming { Gguf, HuggingFace };

// "layers.0.attention.wq.weight" -> "blk.0.attn_q.weight" (GGUF) or
// "model.layers.0.self_attn.q_proj.weight" (Hugging Face); a name it does not know, unchanged.
std::string tensor_name(const std::string& parameter, TensorNaming naming);

// "[64, 172]".
std::string shape_text(const std::vector<int64_t>& dims);

}  // namespace cputrain
