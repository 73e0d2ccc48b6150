#include "models/tensor_names.h"

#include <algorithm>
#include <map>
#include <string_view>
#include <tuple>

#include "engine/train/parameters.h"
#include "models/architecture.h"

namespace cputrain {
namespace {

struct Names {
  const char* ours;
  const char* gguf;
  const char* hf;
};

// By the decoder's name less ".weight" or ".bias", which each format's name keeps.
constexpr Names kModelNames[] = {
    {"tok_embeddings", "token_embd", "model.embed_tokens"},
    {"norm", "output_norm", "model.norm"},
    {"output", "output", "lm_head"},
    // Per-layer embeddings (Gemma 4 E2B, E4B).
    {"per_layer.embeddings", "per_layer_token_embd", "model.embed_tokens_per_layer"},
    {"per_layer.model_proj", "per_layer_model_proj", "model.per_layer_model_projection"},
    {"per_layer.proj_norm", "per_layer_proj_norm", "model.per_layer_projection_norm"},
};

constexpr Names kBlockNames[] = {
    {"attention_norm", "attn_norm", "input_layernorm"},
    {"attention.wq", "attn_q", "self_attn.q_proj"},
    {"attention.wk", "attn_k", "self_attn.k_proj"},
    {"attention.wv", "attn_v", "self_attn.v_proj"},
    {"attention.q_norm", "attn_q_norm", "self_attn.q_norm"},
    {"attention.k_norm", "attn_k_norm", "self_attn.k_norm"},
    {"attention.wo", "attn_output", "self_attn.o_proj"},
    {"attention.sinks", "attn_sinks", "self_attn.sinks"},
    // Fused tensors (Architecture::fused_qkv, fused_gate_up): q, k, v; gate, up.
    {"attention.wqkv", "attn_qkv", "self_attn.qkv_proj"},
    {"feed_forward.w13", "ffn_up", "mlp.gate_up_proj"},
    {"ffn_norm", "ffn_norm", "post_attention_layernorm"},
    {"feed_forward.w1", "ffn_gate", "mlp.gate_proj"},
    {"feed_forward.w3", "ffn_up", "mlp.up_proj"},
    {"feed_forward.w2", "ffn_down", "mlp.down_proj"},
    // A mixture of experts' router and experts (E, F, C; E, C, F), each one tensor.
    {"feed_forward.router", "ffn_gate_inp", "mlp.gate"},
    {"feed_forward.experts.w1", "ffn_gate_exps", "mlp.experts.gate_proj"},
    {"feed_forward.experts.w3", "ffn_up_exps", "mlp.experts.up_proj"},
    {"feed_forward.experts.w2", "ffn_down_exps", "mlp.experts.down_proj"},
    {"feed_forward.shared.w1", "ffn_gate_shexp", "mlp.shared_expert.gate_proj"},
    {"feed_forward.shared.w3", "ffn_up_shexp", "mlp.shared_expert.up_proj"},
    {"feed_forward.shared.w2", "ffn_down_shexp", "mlp.shared_expert.down_proj"},
    {"feed_forward.shared_gate", "ffn_gate_inp_shexp", "mlp.shared_expert_gate"},
    // Norms after attention and the MLP (Architecture::post_norms).
    {"post_attention_norm", "post_attention_norm", "post_attention_layernorm"},
    {"post_ffw_norm", "post_ffw_norm", "post_feedforward_layernorm"},
    // Qwen3.5: attention's q and output gate in one tensor, each head's q rows then its gate's;
    // a Gated DeltaNet layer's parts (q, k, v and their convolutions each in one tensor).
    {"attention.wqg", "attn_q", "self_attn.q_proj"},
    {"linear.wqkv", "attn_qkv", "linear_attn.in_proj_qkv"},
    {"linear.conv", "ssm_conv1d", "linear_attn.conv1d"},
    {"linear.wz", "attn_gate", "linear_attn.in_proj_z"},
    {"linear.wb", "ssm_beta", "linear_attn.in_proj_b"},
    {"linear.wa", "ssm_alpha", "linear_attn.in_proj_a"},
    {"linear.dt_bias", "ssm_dt", "linear_attn.dt_bias"},
    {"linear.a_log", "ssm_a", "linear_attn.A_log"},
    {"linear.gain", "ssm_norm", "linear_attn.norm"},
    {"linear.wo", "ssm_out", "linear_attn.out_proj"},
    // Gemma 4: a layer's per-layer input's gate, projection and norm, and its output scale.
    {"per_layer.gate", "inp_gate", "per_layer_input_gate"},
    {"per_layer.proj", "proj", "per_layer_projection"},
    {"per_layer.norm", "post_norm", "post_per_layer_input_norm"},
    {"layer_scale", "layer_output_scale", "layer_scalar"},
    // Gemma 4 26B-A4B: the experts beside the dense MLP, their norms, the router's input scale
    // and each expert's output scale (GGUF's ffn_gate_inp.scale, ffn_down_exps.scale); the
    // experts' gate and up in one tensor (ModelConfig::experts_gate_up_fused).
    {"moe_norm", "pre_ffw_norm_2", "pre_feedforward_layernorm_2"},
    {"post_mlp_norm", "post_ffw_norm_1", "post_feedforward_layernorm_1"},
    {"post_moe_norm", "post_ffw_norm_2", "post_feedforward_layernorm_2"},
    {"feed_forward.router_scale", "ffn_gate_inp", "router.scale"},
    {"feed_forward.expert_scale", "ffn_down_exps", "router.per_expert_scale"},
    {"feed_forward.experts.w13", "ffn_gate_up_exps", "experts.gate_up_proj"},
};

// The kind a file gives a Gated DeltaNet parameter's tensor: dt_bias is llama.cpp's
// ssm_dt.bias, A (as -exp(A_log)) its bare ssm_a; Hugging Face's are the bare dt_bias and A_log.
std::string file_kind(const std::string& rest, const std::string& kind, bool hf) {
  if (rest == "linear.dt_bias") return hf ? "" : ".bias";
  if (rest == "feed_forward.router_scale" || rest == "feed_forward.expert_scale")
    return hf ? "" : ".scale";
  if (rest == "linear.a_log" || (hf && (rest == "attention.sinks" || rest == "layer_scale")))
    return "";
  return kind;
}

}  // namespace

std::string tensor_name(const std::string& parameter, TensorNaming naming,
                        const Architecture& arch) {
  // An adapter's: its projection's name and llama.cpp's suffix, or PEFT's module name.
  for (const char* suffix : {".lora_a", ".lora_b"}) {
    if (!parameter.ends_with(suffix)) continue;
    const std::string weight =
        tensor_name(parameter.substr(0, parameter.size() - 6) + "weight", naming, arch);
    if (naming == TensorNaming::Gguf) return weight + suffix;
    return "base_model.model." + weight.substr(0, weight.size() - 6) +
           (suffix[6] == 'a' ? "lora_A.weight" : "lora_B.weight");
  }
  const size_t dot = parameter.rfind('.');
  if (dot == std::string::npos) return parameter;
  const std::string base = parameter.substr(0, dot), kind = parameter.substr(dot);
  const bool hf = naming == TensorNaming::HuggingFace;
  // The architecture's own name in the format, where it has one.
  const auto own = [&](const std::string& ours) -> const std::string_view* {
    for (const auto& [from, to] : hf ? arch.hf_names : arch.gguf_names)
      if (from == ours) return &to;
    return nullptr;
  };
  for (const Names& n : kModelNames) {
    if (base != n.ours) continue;
    if (const std::string_view* name = own(base)) return std::string(*name) + kind;
    return (hf ? n.hf : n.gguf) + kind;
  }
  const std::string prefix = "layers.";
  if (base.starts_with(prefix)) {
    const size_t end = base.find('.', prefix.size());
    const std::string layer = base.substr(prefix.size(), end - prefix.size());
    const std::string rest = base.substr(end + 1);
    const std::string at = (hf ? "model.layers." : "blk.") + layer + ".";
    for (const Names& n : kBlockNames) {
      if (rest != n.ours) continue;
      if (const std::string_view* name = own(rest)) return at + std::string(*name) + kind;
      return at + (hf ? n.hf : n.gguf) + file_kind(rest, kind, hf);
    }
  }
  return parameter;
}

bool is_norm_gain(const std::string& name) {
  return name.ends_with("norm.weight");
}

std::vector<float> parameter_values(const ParameterSet& params, int index, const ModelConfig& c,
                                    RopePairs pairs, bool norm_plus_one, bool grouped,
                                    const ValueReader& read) {
  const ParameterInfo& info = params.infos()[static_cast<size_t>(index)];
  std::vector<float> values(static_cast<size_t>(info.shape.numel()));
  if (read)
    read(index, values.data());
  else
    params.read_values(index, values.data());
  reorder_qk_rows(values, info, c, c.rope_pairs, pairs);
  if (grouped) reorder_value_heads(values, info, c, true);
  if (norm_plus_one != c.norm_plus_one && is_norm_gain(info.name)) {
    const float shift = norm_plus_one ? -1.0f : 1.0f;
    for (float& v : values) v += shift;
  }
  return values;
}

void reorder_qk_rows(std::vector<float>& values, const ParameterInfo& info, const ModelConfig& c,
                     RopePairs from, RopePairs to) {
  // A Gated DeltaNet layer's q and k (linear.wq, linear.wk) take no RoPE.
  if (info.name.find(".linear.") != std::string::npos) return;
  const bool q = info.name.find(".wq.") != std::string::npos;
  // A per-head norm's gains are one head's elements.
  const bool norm = info.name.ends_with(".q_norm.weight") || info.name.ends_with(".k_norm.weight");
  // An adapter's A has rank rows, not the projection's: only B's rows are reordered.
  if (from == to || (!q && !norm && info.name.find(".wk.") == std::string::npos) ||
      info.name.ends_with(".lora_a"))
    return;
  // Row j + k * D/2 of a half-split head is row 2j + k of an adjacent one.
  // The layer's heads (Gemma 4's windowed layers have their own).
  int64_t layer = 0;
  if (info.name.starts_with("layers.")) layer = std::stoll(info.name.substr(7));
  const int64_t heads = norm ? 1 : q ? c.n_heads : c.kv_heads(layer);
  const int64_t d = c.head_size(layer), half = d / 2;
  const int64_t row = info.shape.numel() / info.shape[0];
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

namespace {

// Where a parameter holds Gated DeltaNet's value heads: along its rows, or (the output
// projection and its adapter's A) along its columns, `dim` elements a head; dim 0: nowhere.
struct ValueHeads {
  int64_t dim = 0;
  bool columns = false;
};
ValueHeads value_heads_of(const ParameterInfo& info, const ModelConfig& c) {
  const size_t at = info.name.find(".linear.");
  if (at == std::string::npos || c.linear_key_heads <= 0) return {};
  const std::string rest = info.name.substr(at + 8);
  const bool adapter_a = rest.ends_with(".lora_a"), adapter_b = rest.ends_with(".lora_b");
  const std::string base = rest.substr(0, rest.rfind('.'));
  if (base == "wo") return adapter_b ? ValueHeads{} : ValueHeads{c.linear_value_dim, true};
  if (adapter_a) return {};
  if (base == "wv" || base == "wz" || base == "conv_v") return {c.linear_value_dim, false};
  if (base == "wb" || base == "wa" || base == "a_log" || base == "dt_bias") return {1, false};
  return {};
}

}  // namespace

bool value_heads_reordered(const ParameterInfo& info, const ModelConfig& c) {
  return c.linear_value_heads != c.linear_key_heads && value_heads_of(info, c).dim > 0;
}

void reorder_value_heads(std::vector<float>& values, const ParameterInfo& info,
                         const ModelConfig& c, bool to_grouped) {
  if (!value_heads_reordered(info, c)) return;
  const auto [dim, columns] = value_heads_of(info, c);
  const int64_t hk = c.linear_key_heads, per = c.linear_value_heads / hk;
  const int64_t rows = info.shape[0], cols = info.shape.ndim() == 2 ? info.shape[1] : 1;
  // Tiled head j * hk + k is grouped head k * per + j.
  const auto target = [&](int64_t head) {
    return to_grouped ? (head % hk) * per + head / hk : (head % per) * hk + head / per;
  };
  std::vector<float> out(values.size());
  if (!columns) {
    for (int64_t h = 0; h < c.linear_value_heads; ++h)
      std::copy_n(values.begin() + h * dim * cols, dim * cols,
                  out.begin() + target(h) * dim * cols);
  } else {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t h = 0; h < c.linear_value_heads; ++h)
        std::copy_n(values.begin() + r * cols + h * dim, dim,
                    out.begin() + r * cols + target(h) * dim);
  }
  values.swap(out);
}

TensorPart tensor_part(const ParameterInfo& info, const ModelConfig& c, TensorNaming naming) {
  const Architecture& arch = architecture_of(c);
  TensorPart part{tensor_name(info.name, naming, arch), 0, info.shape[0], info.shape[0]};
  if (!info.name.starts_with("layers.")) return part;
  const size_t dot = info.name.find('.', 7);
  const std::string layer = info.name.substr(0, dot + 1), rest = info.name.substr(dot + 1);
  const bool adapter = rest.ends_with(".lora_b"), bias = rest.ends_with(".bias");
  if (!adapter && !bias && !rest.ends_with(".weight")) return part;
  const std::string suffix = adapter ? "lora_b" : bias ? "bias" : "weight";
  // q, k and v in one tensor: Phi-3's in every file, any family's in a GGUF file that holds them
  // so (ModelConfig::qkv_fused).
  const bool fused_qkv = arch.fused_qkv || (c.qkv_fused && naming == TensorNaming::Gguf);
  // (parameter, fused tensor, first row, the fused tensor's rows)
  const int64_t Q = c.q_dim(), KV = c.kv_dim(), F = c.ffn;
  const std::tuple<const char*, const char*, int64_t, int64_t> fused[] = {
      {"attention.wq.", "attention.wqkv.", 0, Q + 2 * KV},
      {"attention.wk.", "attention.wqkv.", Q, Q + 2 * KV},
      {"attention.wv.", "attention.wqkv.", Q + KV, Q + 2 * KV},
      {"feed_forward.w1.", "feed_forward.w13.", 0, 2 * F},
      {"feed_forward.w3.", "feed_forward.w13.", F, 2 * F}};
  for (const auto& [ours, whole, first, rows] : fused) {
    const bool qkv = std::string_view(whole) == "attention.wqkv.";
    if ((qkv ? !fused_qkv : !arch.fused_gate_up || bias) || rest != std::string(ours) + suffix)
      continue;
    return {tensor_name(layer + whole + suffix, naming, arch), first, info.shape[0], rows};
  }
  // A mixture's experts' gate and up in one GGUF tensor: each expert's gate rows, then its up
  // rows (the weights' and their adapters' B).
  const int64_t Fe = c.expert_width();
  const std::tuple<const char*, int64_t> experts[] = {{"feed_forward.experts.w1.", 0},
                                                      {"feed_forward.experts.w3.", Fe}};
  for (const auto& [ours, first] : experts) {
    if (!c.experts_gate_up_fused || naming != TensorNaming::Gguf || bias ||
        rest != std::string(ours) + suffix)
      continue;
    return {tensor_name(layer + "feed_forward.experts.w13." + suffix, naming, arch), first,
            info.shape[1], 2 * Fe, true};
  }
  // Qwen3.5's, in every file: a DeltaNet layer's q, k, v in one tensor and their convolutions in
  // another; attention's q and output gate in one (whose rows file_tensor_values interleaves
  // head by head).
  const int64_t LQ = c.linear_qk_dim(), LV = c.linear_v_dim();
  const std::tuple<const char*, const char*, int64_t, int64_t> qwen35[] = {
      {"linear.wq.", "linear.wqkv.", 0, 2 * LQ + LV},
      {"linear.wk.", "linear.wqkv.", LQ, 2 * LQ + LV},
      {"linear.wv.", "linear.wqkv.", 2 * LQ, 2 * LQ + LV},
      {"linear.conv_q.", "linear.conv.", 0, 2 * LQ + LV},
      {"linear.conv_k.", "linear.conv.", LQ, 2 * LQ + LV},
      {"linear.conv_v.", "linear.conv.", 2 * LQ, 2 * LQ + LV},
      {"attention.wq.", "attention.wqg.", 0, 2 * Q},
      {"attention.wg.", "attention.wqg.", Q, 2 * Q}};
  for (const auto& [ours, whole, first, rows] : qwen35) {
    const bool gate = std::string_view(whole) == "attention.wqg.";
    if (bias || (gate ? !c.attn_output_gate : c.linear_layers.empty()) ||
        rest != std::string(ours) + suffix)
      continue;
    return {tensor_name(layer + whole + suffix, naming, arch), first, info.shape[0], rows};
  }
  return part;
}

std::vector<int64_t> file_tensor_shape(const ParameterInfo& info, const TensorPart& part,
                                       TensorNaming naming) {
  std::vector<int64_t> shape;
  for (int d = 0; d < info.shape.ndim(); ++d) shape.push_back(info.shape[d]);
  shape[part.per_expert ? 1 : 0] = part.tensor_rows;
  // Hugging Face's Conv1d weight: [channels, 1, taps].
  if (naming == TensorNaming::HuggingFace && info.name.find(".linear.conv_") != std::string::npos)
    shape.insert(shape.begin() + 1, 1);
  return shape;
}

bool interleaved_part(const ParameterInfo& info, const ModelConfig& c) {
  if (!c.attn_output_gate) return false;
  for (const char* part : {".attention.wq.", ".attention.wg."})
    for (const char* kind : {"weight", "lora_b"})
      if (info.name.ends_with(std::string(part) + kind)) return true;
  return false;
}

std::vector<float> part_values(const std::vector<float>& tensor, const ParameterInfo& info,
                               const TensorPart& part, const ModelConfig& c) {
  if (part.per_expert) {
    // Each expert's rows of its block of the tensor.
    const int64_t E = info.shape[0], row = info.shape.numel() / (E * part.rows);
    std::vector<float> values(static_cast<size_t>(info.shape.numel()));
    for (int64_t e = 0; e < E; ++e)
      std::copy_n(tensor.begin() + (e * part.tensor_rows + part.first_row) * row, part.rows * row,
                  values.begin() + e * part.rows * row);
    return values;
  }
  const int64_t row = info.shape.numel() / info.shape[0];
  std::vector<float> values(static_cast<size_t>(part.rows * row));
  if (!interleaved_part(info, c)) {
    std::copy_n(tensor.begin() + part.first_row * row, values.size(), values.begin());
    return values;
  }
  const int64_t d = c.head_size(), which = part.first_row == 0 ? 0 : 1;
  for (int64_t h = 0; h < c.n_heads; ++h)
    std::copy_n(tensor.begin() + (2 * h + which) * d * row, d * row, values.begin() + h * d * row);
  return values;
}

std::vector<FileTensor> file_tensors(const ParameterSet& params, const ModelConfig& c,
                                     TensorNaming naming,
                                     const std::function<bool(const ParameterInfo&)>& which) {
  std::vector<FileTensor> out;
  std::vector<std::vector<int64_t>> first_rows;  // of each tensor's parts, as they are added
  std::map<std::string, size_t> at;
  for (size_t i = 0; i < params.infos().size(); ++i) {
    const ParameterInfo& info = params.infos()[i];
    if (!which(info)) continue;
    const TensorPart part = tensor_part(info, c, naming);
    auto [it, added] = at.emplace(part.name, out.size());
    if (added) {
      out.push_back({part.name, file_tensor_shape(info, part, naming), {}});
      first_rows.emplace_back();
    }
    out[it->second].parts.push_back(static_cast<int>(i));
    first_rows[it->second].push_back(part.first_row);
  }
  // Parts in row order.
  for (size_t k = 0; k < out.size(); ++k) {
    std::vector<size_t> order(out[k].parts.size());
    for (size_t j = 0; j < order.size(); ++j) order[j] = j;
    std::sort(order.begin(), order.end(),
              [&](size_t a, size_t b) { return first_rows[k][a] < first_rows[k][b]; });
    std::vector<int> parts;
    for (const size_t j : order) parts.push_back(out[k].parts[j]);
    out[k].parts = std::move(parts);
  }
  return out;
}

std::vector<float> file_tensor_values(const ParameterSet& params, const FileTensor& t,
                                      const ModelConfig& c, RopePairs pairs, bool norm_plus_one,
                                      bool grouped, const ValueReader& read) {
  std::vector<float> values;
  for (const int index : t.parts) {
    const std::vector<float> part =
        parameter_values(params, index, c, pairs, norm_plus_one, grouped, read);
    values.insert(values.end(), part.begin(), part.end());
  }
  // A mixture's experts' parts (gate and up): each expert's block holds its rows of each part.
  if (t.parts.size() > 1 && t.shape.size() == 3 &&
      tensor_part(params.infos()[static_cast<size_t>(t.parts[0])], c, TensorNaming::Gguf)
          .per_expert) {
    const int64_t E = t.shape[0], block = t.shape[1] * t.shape[2];
    const int64_t piece = block / static_cast<int64_t>(t.parts.size());
    std::vector<float> experts(values.size());
    for (int64_t e = 0; e < E; ++e)
      for (size_t j = 0; j < t.parts.size(); ++j)
        std::copy_n(values.begin() + (static_cast<int64_t>(j) * E + e) * piece, piece,
                    experts.begin() + e * block + static_cast<int64_t>(j) * piece);
    values.swap(experts);
  }
  // Attention's q and output gate (Qwen3.5): each head's q rows, then its gate's.
  if (t.parts.size() == 2 && interleaved_part(params.infos()[static_cast<size_t>(t.parts[0])], c)) {
    const int64_t d = c.head_size(), row = t.shape.size() == 2 ? t.shape[1] : 1;
    std::vector<float> heads(values.size());
    for (int64_t h = 0; h < c.n_heads; ++h)
      for (int64_t part = 0; part < 2; ++part)
        std::copy_n(values.begin() + (part * c.n_heads + h) * d * row, d * row,
                    heads.begin() + (2 * h + part) * d * row);
    values.swap(heads);
  }
  return values;
}

std::string shape_text(const std::vector<int64_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

}  // namespace cputrain
