#include "models/gguf_model.h"

#include <algorithm>
#include <set>

#include "engine/error.h"
#include "engine/parameters.h"

namespace cputrain {
namespace {

// Our parameter name's parts, and llama.cpp's.
constexpr std::pair<const char*, const char*> kBlockNames[] = {
    {"attention_norm.weight", "attn_norm.weight"}, {"attention.wq.weight", "attn_q.weight"},
    {"attention.wk.weight", "attn_k.weight"},      {"attention.wv.weight", "attn_v.weight"},
    {"attention.wq.bias", "attn_q.bias"},          {"attention.wk.bias", "attn_k.bias"},
    {"attention.wv.bias", "attn_v.bias"},          {"attention.wo.weight", "attn_output.weight"},
    {"ffn_norm.weight", "ffn_norm.weight"},        {"feed_forward.w1.weight", "ffn_gate.weight"},
    {"feed_forward.w3.weight", "ffn_up.weight"},   {"feed_forward.w2.weight", "ffn_down.weight"},
};

std::string shape_text(const std::vector<int64_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

}  // namespace

std::string gguf_supported_architectures() {
  return "llama, qwen2";
}

LlamaConfig gguf_model_config(const GgufFile& file, int64_t max_ctx) {
  const std::string arch = file.string("general.architecture");
  if (arch != "llama" && arch != "qwen2")
    throw UserError(file.path() + ": architecture " + arch +
                    ", which cputrain does not compute (it computes " +
                    gguf_supported_architectures() + ")");
  const std::string& p = arch;
  LlamaConfig c;
  c.d_model = file.integer(p + ".embedding_length");
  c.n_layers = file.integer(p + ".block_count");
  c.ffn = file.integer(p + ".feed_forward_length");
  c.n_heads = file.integer(p + ".attention.head_count");
  c.n_kv_heads = file.integer(p + ".attention.head_count_kv", c.n_heads);
  c.head_dim =
      file.integer(p + ".attention.key_length", c.d_model / std::max<int64_t>(1, c.n_heads));
  if (file.integer(p + ".attention.value_length", c.head_dim) != c.head_dim)
    throw UserError(file.path() + ": " + p +
                    ".attention.value_length differs from key_length, "
                    "which cputrain does not compute");
  c.norm_eps = static_cast<float>(file.number(p + ".attention.layer_norm_rms_epsilon", 1e-5));
  c.rope_theta = file.number(p + ".rope.freq_base", 10000.0);
  c.ctx = std::min(file.integer(p + ".context_length"), max_ctx);
  c.rope_pairs = arch == "qwen2" ? RopePairs::HalfSplit : RopePairs::Adjacent;
  if (file.integer(p + ".rope.dimension_count", c.head_dim) != c.head_dim)
    throw UserError(file.path() + ": " + p + ".rope.dimension_count " +
                    std::to_string(file.integer(p + ".rope.dimension_count")) +
                    " rotates part of each head, which cputrain does not compute");
  const std::string scaling = file.string(p + ".rope.scaling.type", "none");
  if (scaling != "none" || file.tensor("rope_freqs.weight"))
    throw UserError(file.path() + ": RoPE scaling (" +
                    (scaling != "none" ? scaling : std::string("rope_freqs.weight")) +
                    "), which cputrain does not compute");
  const GgufTensor* embedding = file.tensor("token_embd.weight");
  if (!embedding || embedding->dims.size() != 2)
    throw UserError(file.path() + ": no token_embd.weight of two dimensions");
  c.vocab = embedding->dims[1];
  c.tie_embeddings = file.tensor("output.weight") == nullptr;
  c.qkv_bias = file.tensor("blk.0.attn_q.bias") != nullptr;
  if (const auto problem = validate(c))
    throw UserError(file.path() +
                    ": the model's hyperparameters do not fit together: " + problem->str());
  return c;
}

std::string gguf_tensor_name(const std::string& parameter) {
  if (parameter == "tok_embeddings.weight") return "token_embd.weight";
  if (parameter == "norm.weight") return "output_norm.weight";
  if (parameter == "output.weight") return "output.weight";
  const std::string prefix = "layers.";
  if (parameter.starts_with(prefix)) {
    const size_t dot = parameter.find('.', prefix.size());
    const std::string layer = parameter.substr(prefix.size(), dot - prefix.size());
    const std::string rest = parameter.substr(dot + 1);
    for (const auto& [ours, theirs] : kBlockNames)
      if (rest == ours) return "blk." + layer + "." + theirs;
  }
  return parameter;
}

void load_gguf_weights(const GgufFile& file, const ParameterSet& params) {
  std::set<std::string> used;
  for (size_t i = 0; i < params.infos().size(); ++i) {
    const ParameterInfo& info = params.infos()[i];
    const std::string name = gguf_tensor_name(info.name);
    const GgufTensor* t = file.tensor(name);
    if (!t)
      throw UserError(file.path() + ": no tensor " + name + " (the model's " + info.name + ")");
    std::vector<int64_t> expected;
    for (int d = info.shape.ndim() - 1; d >= 0; --d) expected.push_back(info.shape[d]);
    if (t->dims != expected)
      throw UserError(file.path() + ": tensor " + name + " has shape " + shape_text(t->dims) +
                      " where the model's hyperparameters give " + shape_text(expected));
    const std::vector<float> values = gguf_tensor_values(file, *t);
    params.write_values(static_cast<int>(i), values.data());
    used.insert(name);
  }
  for (const GgufTensor& t : file.tensors()) {
    // A tied model's file may hold the head as well, a copy of the embedding.
    if (used.count(t.name) || t.name == "output.weight") continue;
    throw UserError(file.path() + ": tensor " + t.name + " has no place in the " +
                    file.string("general.architecture") + " model cputrain computes");
  }
}

}  // namespace cputrain
