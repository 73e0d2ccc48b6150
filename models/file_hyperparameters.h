// A model file's hyperparameters checked against the tensors the file holds, before anything is
// allocated from them: every count positive, each dimension the one its tensors have (the width
// and rows of the embedding, the blocks present, the rows of the first block's q, k and gate
// projections), the context within what cputrain computes, and then every tensor of the model
// present with its shape. A damaged or hostile file (a block count of a million, a head count of
// 0) is one UserError naming the file and the key, whatever the file claims.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "models/model_config.h"
#include "models/tensor_names.h"

namespace cputrain {

// The longest context a model file may declare: above every published model's (10M tokens).
inline constexpr int64_t kMaxFileContext = int64_t{1} << 24;
// The most a Gated DeltaNet count (heads, a head's width, taps) a file gives may be: above every
// model's, well within int64 products.
inline constexpr int64_t kMaxLinearCount = int64_t{1} << 20;

// One hyperparameter as the file gives it: its key in the file's terms ("llama.block_count",
// "num_hidden_layers") and its value, absent where the file does not give it.
struct FileHyperparameter {
  std::string key;
  std::optional<int64_t> value;
};

struct FileHyperparameters {
  std::string where;  // the file the values come from, for messages
  TensorNaming naming = TensorNaming::Gguf;
  FileHyperparameter vocab;       // optional: the embedding's rows where absent
  FileHyperparameter d_model;     // required
  FileHyperparameter n_layers;    // required
  FileHyperparameter n_heads;     // required
  FileHyperparameter n_kv_heads;  // optional: n_heads
  FileHyperparameter head_dim;    // optional: d_model / n_heads
  FileHyperparameter ffn;         // required
  FileHyperparameter ctx;         // required (a format's default given as its value)
  FileHyperparameter rope_dim;    // optional: the head dimension
  // A mixture of experts (Architecture::moe): the experts and those a token uses, required
  // there; ffn is then each expert's width.
  FileHyperparameter n_experts;
  FileHyperparameter experts_used;
  FileHyperparameter shared_expert_ffn;  // required where the architecture has a shared expert
  // The experts' width where they are beside a dense MLP (Architecture::experts_beside_mlp);
  // given there where n_experts is.
  FileHyperparameter expert_ffn;
  // Blocks the file holds after the model's n_layers that the model leaves out (a
  // multi-token-prediction block, numbered after the model's layers).
  int64_t extra_blocks = 0;
  // Where layers differ in shape (Gemma 4's): run once the first layer's heads and MLP width
  // are read into the config, before every tensor is checked against it, to set the other
  // layers' shapes.
  std::function<void(ModelConfig&)> layer_shapes;
};

// The shape of the file's tensor `name` (in the file's naming) as DecoderModel holds it (a matrix
// [out, in]); nullopt where the file has no such tensor.
using FileTensorShape = std::function<std::optional<std::vector<int64_t>>(const std::string&)>;

// Sets `config`'s vocab, d_model, n_layers, n_heads, n_kv_heads, head_dim (where the file gives
// it), ffn and ctx (uncapped) from `hp`, each checked against the file's tensors (`names`, all of
// them; `shape_of`), and then checks that every parameter of a model of `config` (its
// tie_embeddings and qkv_bias already set, no adapters) has its tensor in the file with its
// shape. A UserError naming hp.where and the key, or the tensor, otherwise. Allocates nothing
// that the file's size does not bound.
void check_file_hyperparameters(const FileHyperparameters& hp,
                                const std::vector<std::string>& names,
                                const FileTensorShape& shape_of, ModelConfig& config);

}  // namespace cputrain
