#include "models/tensor_names.h"

#include <algorithm>

#include "engine/train/parameters.h"

namespace cputrain {
namespace {

struct Names {
  const char* ours;
  const char* gguf;
  const char* hf;
};

constexpr Names kModelNames[] = {
    {"tok_embeddings.weight", "token_embd.weight", "model.embed_tokens.weight"},
    {"norm.weight", "output_norm.weight", "model.norm.weight"},
    {"output.weight", "output.weight", "lm_head.weight"},
};

constexpr Names kBlockNames[] = {
    {"attention_norm.weight", "attn_norm.weight", "input_layernorm.weight"},
    {"attention.wq.weight", "attn_q.weight", "self_attn.q_proj.weight"},
    {"attention.wk.weight", "attn_k.weight", "self_attn.k_proj.weight"},
    {"attention.wv.weight", "attn_v.weight", "self_attn.v_proj.weight"},
    {"attention.wq.bias", "attn_q.bias", "self_attn.q_proj.bias"},
    {"attention.wk.bias", "attn_k.bias", "self_attn.k_proj.bias"},
    {"attention.wv.bias", "attn_v.bias", "self_attn.v_proj.bias"},
    {"attention.wo.weight", "attn_output.weight", "self_attn.o_proj.weight"},
    {"ffn_norm.weight", "ffn_norm.weight", "post_attention_layernorm.weight"},
    {"feed_forward.w1.weight", "ffn_gate.weight", "mlp.gate_proj.weight"},
    {"feed_forward.w3.weight", "ffn_up.weight", "mlp.up_proj.weight"},
    {"feed_forward.w2.weight", "ffn_down.weight", "mlp.down_proj.weight"},
};

}  // namespace

std::string tensor_name(const std::string& parameter, TensorNaming naming) {
  // An adapter's: its projection's name and llama.cpp's suffix, or PEFT's module name.
  for (const char* suffix : {".lora_a", ".lora_b"}) {
    if (!parameter.ends_with(suffix)) continue;
    const std::string weight =
        tensor_name(parameter.substr(0, parameter.size() - 6) + "weight", naming);
    if (naming == TensorNaming::Gguf) return weight + suffix;
    return "base_model.model." + weight.substr(0, weight.size() - 6) +
           (suffix[6] == 'a' ? "lora_A.weight" : "lora_B.weight");
  }
  const auto pick = [naming](const Names& n) {
    return std::string(naming == TensorNaming::Gguf ? n.gguf : n.hf);
  };
  for (const Names& n : kModelNames)
    if (parameter == n.ours) return pick(n);
  const std::string prefix = "layers.";
  if (parameter.starts_with(prefix)) {
    const size_t dot = parameter.find('.', prefix.size());
    const std::string layer = parameter.substr(prefix.size(), dot - prefix.size());
    const std::string rest = parameter.substr(dot + 1);
    for (const Names& n : kBlockNames)
      if (rest == n.ours)
        return (naming == TensorNaming::Gguf ? "blk." : "model.layers.") + layer + "." + pick(n);
  }
  return parameter;
}

std::vector<float> parameter_values(const ParameterSet& params, int index, const LlamaConfig& c,
                                    RopePairs pairs) {
  const ParameterInfo& info = params.infos()[static_cast<size_t>(index)];
  std::vector<float> values(static_cast<size_t>(info.shape.numel()));
  params.read_values(index, values.data());
  reorder_qk_rows(values, info, c, c.rope_pairs, pairs);
  return values;
}

void reorder_qk_rows(std::vector<float>& values, const ParameterInfo& info, const LlamaConfig& c,
                     RopePairs from, RopePairs to) {
  const bool q = info.name.find(".wq.") != std::string::npos;
  // An adapter's A has rank rows, not the projection's: only B's rows are reordered.
  if (from == to || (!q && info.name.find(".wk.") == std::string::npos) ||
      info.name.ends_with(".lora_a"))
    return;
  // Row j + k * D/2 of a half-split head is row 2j + k of an adjacent one.
  const int64_t heads = q ? c.n_heads : c.kv_heads(), d = c.head_size(), half = d / 2;
  const int64_t row = info.shape.ndim() == 2 ? info.shape[1] : 1;
  std::vector<float> out(values.size());
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t j = 0; j < half; ++j)
      for (int64_t k = 0; k < 2; ++k) {
        const int64_t split = h * d + j + k * half, adjacent = h * d + 2 * j + k;
        const int64_t src = to == RopePairs::Adjacent ? split : adjacent;
        const int64_t dst = to == RopePairs::Adjacent ? adjacent : split;
        std::copy_n(values.begin() + src * row, row, out.begin() + dst * row);
      }
  values.swap(out);
}

std::string shape_text(const std::vector<int64_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

}  // namespace cputrain
