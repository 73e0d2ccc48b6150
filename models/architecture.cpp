#include "models/architecture.h"

#include <algorithm>
#include <array>
#include <stdexcept>
#include <string_view>

#include "engine/core/error.h"

namespace cputrain {
namespace {

// config.json keys of every architecture: read (the shape, norms, RoPE, biases, the window), or
// notes that change nothing computed (token ids, dtype, versions, initialisation, caching).
constexpr std::string_view kHfCommonKeys[] = {
    // read
    "model_type", "architectures", "vocab_size", "hidden_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
    "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling", "tie_word_embeddings",
    "hidden_act", "attention_bias", "mlp_bias", "attention_dropout", "use_sliding_window",
    "sliding_window", "max_window_layers", "layer_types",
    // notes
    "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "dtype", "transformers_version",
    "initializer_range", "use_cache", "pretraining_tp", "auto_map"};

// The keys a mixture of experts' files add (qwen3moe's; qwen35moe's with its shared expert's).
constexpr std::array<std::string_view, 3> kMoeGgufKeys = {"expert_count", "expert_used_count",
                                                          "expert_feed_forward_length"};
constexpr std::array<std::string_view, 8> kMoeHfKeys = {
    "num_experts",         "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
    "decoder_sparse_step", "mlp_only_layers",     "router_aux_loss_coef",  "output_router_logits"};

std::vector<Architecture> table() {
  std::vector<Architecture> t;
  {
    Architecture a;
    a.name = "llama";
    a.hf_model_types = {"llama", "mistral"};
    a.hf_class = "LlamaForCausalLM";
    a.gguf_rope_pairs = RopePairs::Adjacent;
    a.qkv_bias = Presence::Optional;
    a.rope_scalings = {"llama3"};
    a.summary =
        "RMSNorm, SwiGLU, RoPE (adjacent pairs in GGUF); Llama 3's RoPE scaling where the "
        "model has it";
    t.push_back(a);
  }
  {
    Architecture a;
    a.name = "qwen2";
    a.hf_model_types = {"qwen2"};
    a.hf_class = "Qwen2ForCausalLM";
    a.gguf_rope_pairs = RopePairs::HalfSplit;
    a.qkv_bias = Presence::Always;
    a.summary = "llama's block with q/k/v biases, half-split RoPE";
    t.push_back(a);
  }
  {
    Architecture a;
    a.name = "qwen3";
    a.hf_model_types = {"qwen3"};
    a.hf_class = "Qwen3ForCausalLM";
    a.gguf_rope_pairs = RopePairs::HalfSplit;
    a.qk_norm = true;
    a.summary = "llama's block with per-head RMSNorm of q and k before RoPE, half-split RoPE";
    t.push_back(a);
  }
  {
    Architecture a;
    a.name = "qwen3moe";
    a.hf_model_types = {"qwen3_moe"};
    a.hf_class = "Qwen3MoeForCausalLM";
    a.gguf_rope_pairs = RopePairs::HalfSplit;
    a.qk_norm = true;
    a.moe = true;
    a.gguf_keys.assign(kMoeGgufKeys.begin(), kMoeGgufKeys.end());
    a.hf_keys.assign(kMoeHfKeys.begin(), kMoeHfKeys.end());
    a.summary =
        "qwen3's attention, and in every MLP's place a mixture of SwiGLU experts: a softmax "
        "router over them, each token's top k renormalised";
    t.push_back(a);
  }
  {
    Architecture a;
    a.name = "qwen35";
    a.hf_model_types = {"qwen3_5_text"};
    a.hf_multimodal_types = {"qwen3_5"};
    a.hf_class = "Qwen3_5ForCausalLM";
    a.gguf_rope_pairs = RopePairs::HalfSplit;
    a.qk_norm = true;
    a.partial_rotary = true;
    a.hf_norm_plus_one = true;
    a.linear_attention_step = 4;
    a.attn_output_gate = true;
    a.gguf_names = {{"ffn_norm", "post_attention_norm"}};
    a.hf_keys = {"attn_output_gate",       "full_attention_interval",
                 "linear_conv_kernel_dim", "linear_key_head_dim",
                 "linear_value_head_dim",  "linear_num_key_heads",
                 "linear_num_value_heads", "rope_parameters",
                 "mtp_num_hidden_layers",  "mtp_use_dedicated_embeddings"};
    a.gguf_keys = {"ssm.conv_kernel",
                   "ssm.inner_size",
                   "ssm.state_size",
                   "ssm.time_step_rank",
                   "ssm.group_count",
                   "full_attention_interval",
                   "attention.recurrent_layers",
                   "rope.dimension_sections",
                   "nextn_predict_layers"};
    a.summary =
        "Qwen3.5: three of every four layers Gated DeltaNet (linear attention with a recurrent "
        "state), the fourth attention with q/k norms, partial half-split RoPE and a gated output";
    t.push_back(a);
    // Qwen3.5's mixtures of experts: its layers, qwen3moe's experts in every MLP's place and a
    // shared expert beside them.
    Architecture m = a;
    m.name = "qwen35moe";
    m.hf_model_types = {"qwen3_5_moe_text"};
    m.hf_multimodal_types = {"qwen3_5_moe"};
    m.hf_class = "Qwen3_5MoeForCausalLM";
    m.moe = true;
    m.shared_expert = true;
    m.gguf_keys.insert(m.gguf_keys.end(), kMoeGgufKeys.begin(), kMoeGgufKeys.end());
    m.gguf_keys.push_back("expert_shared_feed_forward_length");
    m.hf_keys.insert(m.hf_keys.end(), kMoeHfKeys.begin(), kMoeHfKeys.end());
    m.hf_keys.push_back("shared_expert_intermediate_size");
    m.summary =
        "Qwen3.5's layers, and in every MLP's place qwen3moe's experts beside a shared expert "
        "whose output a sigmoid gate scales";
    t.push_back(m);
  }
  {
    Architecture a;
    a.name = "gpt-oss";
    a.hf_model_types = {"gpt_oss"};
    a.hf_class = "GptOssForCausalLM";
    a.gguf_rope_pairs = RopePairs::HalfSplit;
    a.qkv_bias = Presence::Always;
    a.attn_out_bias = true;
    a.attn_sinks = true;
    a.swa_pattern = 2;
    a.default_window = 128;
    a.rope_scalings = {"yarn"};
    a.moe = true;
    a.moe_gating = kernels::MoeGating::SoftmaxTopK;
    a.moe_biases = true;
    a.moe_activation = kernels::Activation::SiluClamped;
    a.gguf_names = {{"ffn_norm", "post_attention_norm"}};
    a.hf_gpt_oss_experts = true;
    a.hf_names = {{"feed_forward.router", "mlp.router"}};
    a.hf_keys = {"num_local_experts",     "num_experts_per_tok",  "experts_per_token",
                 "router_aux_loss_coef",  "output_router_logits", "swiglu_limit",
                 "initial_context_length"};
    a.gguf_keys.assign(kMoeGgufKeys.begin(), kMoeGgufKeys.end());
    a.gguf_keys.insert(a.gguf_keys.end(),
                       {"attention.sliding_window", "attention.sliding_window_pattern",
                        "rope.freq_base_swa", "rope.scaling.factor",
                        "rope.scaling.original_context_length", "rope.scaling.attn_factor"});
    a.summary =
        "attention with q/k/v/o biases and a learnt sink per head, every other layer "
        "within a sliding window (128), YaRN RoPE; in every MLP's place experts with biases and a "
        "clamped SwiGLU, each token's top k logits softmaxed";
    t.push_back(a);
  }
  {
    Architecture a;
    a.name = "phi3";
    a.hf_model_types = {"phi3"};
    a.hf_class = "Phi3ForCausalLM";
    a.gguf_rope_pairs = RopePairs::HalfSplit;
    a.fused_qkv = true;
    a.fused_gate_up = true;
    a.partial_rotary = true;
    a.rope_scalings = {"longrope"};
    a.hf_keys = {"original_max_position_embeddings", "partial_rotary_factor", "resid_pdrop",
                 "embd_pdrop"};
    a.gguf_keys = {"attention.sliding_window", "rope.scaling.attn_factor",
                   "rope.scaling.original_context_length"};
    a.summary =
        "llama's block with q, k, v and gate, up each one tensor, half-split RoPE (partial in "
        "Phi-4-mini), longrope scaling where the model has it";
    t.push_back(a);
  }
  {
    Architecture a;
    a.name = "smollm3";
    a.hf_model_types = {"smollm3"};
    a.hf_class = "SmolLM3ForCausalLM";
    a.gguf_rope_pairs = RopePairs::Adjacent;
    a.no_rope_layer_step = 4;
    a.hf_keys = {"no_rope_layers", "no_rope_layer_interval"};
    a.summary = "llama's block, every fourth layer without RoPE";
    t.push_back(a);
  }
  {
    Architecture a;
    a.name = "gemma";
    a.hf_model_types = {"gemma"};
    a.hf_class = "GemmaForCausalLM";
    a.gguf_rope_pairs = RopePairs::HalfSplit;
    a.mlp = Mlp::GeGlu;
    a.scale_embeddings = true;
    a.hf_norm_plus_one = true;
    a.always_tied = true;
    a.hf_keys = {"hidden_activation"};
    a.summary =
        "RMSNorm scaling by 1 + w, GeGLU (tanh GELU), embeddings scaled by sqrt(d_model), "
        "half-split RoPE, a tied head";
    t.push_back(a);
  }
  {
    Architecture a;
    a.name = "phi2";
    a.hf_model_types = {"phi"};
    a.hf_class = "PhiForCausalLM";
    a.gguf_rope_pairs = RopePairs::HalfSplit;
    a.qkv_bias = Presence::Always;
    a.partial_rotary = true;
    a.mlp = Mlp::Gelu;
    a.norm = Norm::LayerNorm;
    a.parallel_block = true;
    a.dense_biases = true;
    a.hf_names = {{"attention.wo", "self_attn.dense"},
                  {"feed_forward.w3", "mlp.fc1"},
                  {"feed_forward.w2", "mlp.fc2"},
                  {"norm", "model.final_layernorm"}};
    a.hf_keys = {"layer_norm_eps", "partial_rotary_factor", "resid_pdrop", "embd_pdrop",
                 "qk_layernorm"};
    a.gguf_keys = {"attention.layer_norm_epsilon"};
    a.summary =
        "attention and a GELU MLP (fc1, fc2) in parallel from one LayerNorm with a bias, biases on "
        "every projection and the head, half-split RoPE on part of each head";
    t.push_back(a);
  }
  {
    Architecture a;
    a.name = "gemma2";
    a.hf_model_types = {"gemma2"};
    a.hf_class = "Gemma2ForCausalLM";
    a.gguf_rope_pairs = RopePairs::HalfSplit;
    a.mlp = Mlp::GeGlu;
    a.scale_embeddings = true;
    a.hf_norm_plus_one = true;
    a.always_tied = true;
    a.post_norms = true;
    a.swa_pattern = 2;
    a.default_window = 4096;
    a.default_attn_softcap = 50.0f;
    a.default_final_softcap = 30.0f;
    a.attn_softcap = true;
    a.width_scaled_layers = 46;
    a.hf_names = {{"ffn_norm", "pre_feedforward_layernorm"},
                  {"post_attention_norm", "post_attention_layernorm"},
                  {"post_ffw_norm", "post_feedforward_layernorm"}};
    a.hf_keys = {"hidden_activation", "query_pre_attn_scalar", "final_logit_softcapping",
                 "attn_logit_softcapping", "cache_implementation"};
    a.gguf_keys = {"attention.sliding_window", "attention.sliding_window_pattern",
                   "rope.freq_base_swa", "attn_logit_softcapping", "final_logit_softcapping"};
    a.summary =
        "Gemma's block with norms after attention and the MLP; attention scores soft-capped (50) "
        "and final logits (30); every other layer within a sliding window (4096)";
    t.push_back(a);
  }
  {
    Architecture a;
    a.name = "gemma3";
    a.hf_model_types = {"gemma3_text"};
    a.hf_class = "Gemma3ForCausalLM";
    a.gguf_rope_pairs = RopePairs::HalfSplit;
    a.qk_norm = true;
    a.mlp = Mlp::GeGlu;
    a.scale_embeddings = true;
    a.hf_norm_plus_one = true;
    a.always_tied = true;
    a.post_norms = true;
    a.swa_pattern = 6;
    a.default_window = 4096;
    a.rope_scalings = {"linear"};
    a.default_rope_theta_swa = 10000.0;
    a.width_scaled_layers = 62;
    a.hf_names = {{"ffn_norm", "pre_feedforward_layernorm"},
                  {"post_attention_norm", "post_attention_layernorm"},
                  {"post_ffw_norm", "post_feedforward_layernorm"}};
    a.hf_keys = {"hidden_activation",    "query_pre_attn_scalar",      "sliding_window_pattern",
                 "rope_local_base_freq", "final_logit_softcapping",    "attn_logit_softcapping",
                 "cache_implementation", "use_bidirectional_attention"};
    a.gguf_keys = {"attention.sliding_window", "attention.sliding_window_pattern",
                   "rope.freq_base_swa", "final_logit_softcapping", "rope.scaling.factor"};
    a.summary =
        "Gemma's block with per-head q/k norms and norms after attention and the MLP; five "
        "sliding-window layers to one global, RoPE base 10,000 on the windowed ones; linear "
        "RoPE scaling on the global ones (4B and larger)";
    t.push_back(a);
  }
  {
    Architecture a;
    a.name = "gemma4";
    a.hf_model_types = {"gemma4_text"};
    a.hf_multimodal_types = {"gemma4"};
    a.hf_class = "Gemma4ForCausalLM";
    a.gguf_rope_pairs = RopePairs::HalfSplit;
    a.qk_norm = true;
    a.partial_rotary = true;
    a.mlp = Mlp::GeGlu;
    a.scale_embeddings = true;
    a.always_tied = true;
    a.post_norms = true;
    a.swa_pattern = 5;
    a.default_window = 512;
    // Proportional RoPE: the global layers' rope_freqs, a factor of 1e30 for each pair that
    // does not rotate.
    a.rope_scalings = {"factors"};
    a.default_rope_theta_swa = 10000.0;
    a.v_norm = true;
    a.unscaled_scores = true;
    a.layer_output_scale = true;
    a.layer_shapes = true;
    a.per_layer_inputs = true;
    a.experts_beside_mlp = true;
    a.moe_activation = kernels::Activation::GeluTanh;
    a.k_as_v = true;
    // The experts and their router beside the MLP, not in its place.
    a.hf_names = {{"ffn_norm", "pre_feedforward_layernorm"},
                  {"post_attention_norm", "post_attention_layernorm"},
                  {"post_ffw_norm", "post_feedforward_layernorm"},
                  {"feed_forward.router", "router.proj"},
                  {"feed_forward.experts.w1", "experts.gate_proj"},
                  {"feed_forward.experts.w3", "experts.up_proj"},
                  {"feed_forward.experts.w13", "experts.gate_up_proj"},
                  {"feed_forward.experts.w2", "experts.down_proj"}};
    a.hf_keys = {"hidden_activation",
                 "final_logit_softcapping",
                 "rope_parameters",
                 "global_head_dim",
                 "num_global_key_value_heads",
                 "attention_k_eq_v",
                 "num_kv_shared_layers",
                 "hidden_size_per_layer_input",
                 "vocab_size_per_layer_input",
                 "use_double_wide_mlp",
                 "enable_moe_block",
                 "num_experts",
                 "top_k_experts",
                 "moe_intermediate_size",
                 "expert_intermediate_size",
                 "use_bidirectional_attention"};
    a.gguf_keys = {"attention.sliding_window",   "attention.sliding_window_pattern",
                   "rope.freq_base_swa",         "final_logit_softcapping",
                   "attention.key_length_swa",   "attention.value_length_swa",
                   "rope.dimension_count_swa",   "embedding_length_per_layer_input",
                   "attention.shared_kv_layers", "expert_count",
                   "expert_used_count",          "expert_feed_forward_length"};
    a.summary =
        "Gemma 3's block with v normed, unscaled scores, a learnt scale of each layer's output "
        "and a soft-cap on the logits; windowed layers with their own head size, global ones "
        "with proportional RoPE; per-layer embeddings and layers sharing keys and values (E2B, "
        "E4B); GELU experts beside the MLP (26B-A4B); global layers taking k as v (31B)";
    t.push_back(a);
  }
  return t;
}

std::string joined(const std::vector<std::string_view>& names) {
  std::string s;
  for (const std::string_view n : names) s += (s.empty() ? "" : ", ") + std::string(n);
  return s;
}

}  // namespace

std::string_view mlp_name(Mlp mlp) {
  return mlp == Mlp::SwiGlu ? "SwiGLU" : mlp == Mlp::GeGlu ? "GeGLU" : "GELU";
}

const std::vector<Architecture>& architectures() {
  static const std::vector<Architecture> t = table();
  return t;
}

const Architecture* find_architecture(std::string_view name) {
  for (const Architecture& a : architectures())
    if (a.name == name) return &a;
  return nullptr;
}

const Architecture* find_hf_architecture(std::string_view type) {
  for (const Architecture& a : architectures())
    for (const std::string_view t : a.hf_model_types)
      if (t == type) return &a;
  return nullptr;
}

const Architecture& architecture_of(const ModelConfig& config) {
  const Architecture* a = find_architecture(config.architecture);
  if (!a)
    throw std::invalid_argument("architecture " + config.architecture +
                                " is not one cputrain computes (" + architecture_names() + ")");
  return *a;
}

std::string architecture_names() {
  std::vector<std::string_view> names;
  for (const Architecture& a : architectures()) names.push_back(a.name);
  return joined(names);
}

std::string expert_architecture_names() {
  std::vector<std::string_view> names;
  for (const Architecture& a : architectures())
    if (a.moe || a.experts_beside_mlp) names.push_back(a.name);
  return joined(names);
}

std::string hf_model_type_names() {
  std::vector<std::string_view> names;
  for (const Architecture& a : architectures())
    names.insert(names.end(), a.hf_model_types.begin(), a.hf_model_types.end());
  std::sort(names.begin(), names.end());
  return joined(names);
}

std::string rope_scaling_names(const Architecture& arch) {
  return arch.rope_scalings.empty() ? "none" : joined(arch.rope_scalings);
}

bool hf_key_known(const Architecture& arch, std::string_view key) {
  if (key.starts_with("_")) return true;
  for (const std::string_view k : kHfCommonKeys)
    if (k == key) return true;
  return std::find(arch.hf_keys.begin(), arch.hf_keys.end(), key) != arch.hf_keys.end();
}

std::vector<int64_t> step_no_rope_layers(const Architecture& arch, int64_t layers) {
  std::vector<int64_t> out;
  if (arch.no_rope_layer_step > 0)
    for (int64_t i = arch.no_rope_layer_step - 1; i < layers; i += arch.no_rope_layer_step)
      out.push_back(i);
  return out;
}

std::vector<int64_t> linear_layers_between(int64_t interval, int64_t layers) {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < layers; ++i)
    if ((i + 1) % interval != 0) out.push_back(i);
  return out;
}

std::vector<int64_t> step_linear_layers(const Architecture& arch, int64_t layers) {
  if (arch.linear_attention_step <= 0) return {};
  return linear_layers_between(arch.linear_attention_step, layers);
}

std::string router_losses_refusal(const ModelConfig& c) {
  if (!c.moe()) return "the model has no experts";
  const Architecture& arch = architecture_of(c);
  if (arch.moe_gating != kernels::MoeGating::Softmax)
    return std::string(arch.name) +
           "'s router (top k, then a softmax over them) takes no router "
           "losses";
  return {};
}

void require_files(const Architecture& arch, const std::string& what) {
  if (!arch.files)
    throw UserError(what + ": " + std::string(arch.name) +
                    " files are not read or written yet (cputrain train --arch " +
                    std::string(arch.name) + " trains one; its run's checkpoint holds it)");
}

std::string architecture_mismatch(const ModelConfig& c) {
  const Architecture* a = find_architecture(c.architecture);
  if (!a) return "architecture " + c.architecture + " is not one of " + architecture_names();
  const std::string of = " in a " + std::string(a->name) + " model";
  if (c.qkv_bias && a->qkv_bias == Presence::Never) return "q/k/v biases" + of;
  if (!c.qkv_bias && a->qkv_bias == Presence::Always) return "no q/k/v biases" + of;
  if (c.qk_norm != a->qk_norm) return std::string(c.qk_norm ? "q/k norms" : "no q/k norms") + of;
  if (c.rope_scaling.active() && c.rope_scaling.type != "factors" &&
      std::find(a->rope_scalings.begin(), a->rope_scalings.end(), c.rope_scaling.type) ==
          a->rope_scalings.end())
    return "RoPE scaling " + c.rope_scaling.type + of + " (it applies " + rope_scaling_names(*a) +
           ")";
  if (c.rope_scaling.type == "factors" && a->rope_scalings.empty())
    return "RoPE frequency factors" + of;
  if (a->no_rope_layer_step == 0 && !c.no_rope_layers.empty()) return "layers without RoPE" + of;
  if (c.rope_dim > 0 && !a->partial_rotary) return "RoPE on part of each head" + of;
  if (c.norm_plus_one && !a->hf_norm_plus_one) return "norm weights held less 1" + of;
  if (a->always_tied && !c.tie_embeddings) return "an LM head of its own" + of;
  if (c.sliding_window > 0 && a->swa_pattern == 0) return "sliding-window layers" + of;
  if (c.attn_softcap > 0.0f && !a->attn_softcap) return "soft-capped attention scores" + of;
  if (c.final_softcap > 0.0f && a->swa_pattern == 0) return "soft-capped logits" + of;
  if (!c.linear_layers.empty() && a->linear_attention_step == 0)
    return "Gated DeltaNet layers" + of;
  if (c.per_layer_dim > 0 && !a->per_layer_inputs) return "per-layer embeddings" + of;
  if (c.layers_differ() && !a->layer_shapes) return "layers of different shapes" + of;
  if (c.moe() && !a->moe && !a->experts_beside_mlp) return "experts" + of;
  if (a->experts_beside_mlp && c.moe() != c.experts_beside_mlp())
    return "experts in the MLP's place" + of;
  if (a->moe && c.expert_ffn > 0) return "experts beside a dense MLP" + of;
  if (c.k_as_v && !a->k_as_v) return "global layers taking k as v" + of;
  if (c.attn_output_gate != a->attn_output_gate)
    return std::string(c.attn_output_gate ? "an attention output gate"
                                          : "no attention output gate") +
           of;
  return "";
}

ModelConfig with_architecture(ModelConfig c, const Architecture& arch) {
  c.architecture = std::string(arch.name);
  c.qkv_bias = arch.qkv_bias == Presence::Always;
  c.qk_norm = arch.qk_norm;
  c.rope_pairs = arch.gguf_rope_pairs;
  c.no_rope_layers = step_no_rope_layers(arch, c.n_layers);
  c.norm_plus_one = false;
  if (arch.always_tied) c.tie_embeddings = true;
  c.swa_pattern = arch.swa_pattern;
  c.attn_softcap = arch.default_attn_softcap;
  c.final_softcap = arch.default_final_softcap;
  c.attn_output_gate = arch.attn_output_gate;
  c.linear_layers = step_linear_layers(arch, c.n_layers);
  if (arch.moe && !c.moe()) {
    // Qwen3-MoE's proportions, scaled: 8 experts, 2 of them a token, each of an eighth of the
    // MLP's width (at least 16).
    c.n_experts = 8;
    c.experts_used = 2;
    c.ffn = std::max<int64_t>(16, c.ffn / 8);
    // Qwen3.5-MoE's shared expert: as wide as one expert.
    if (arch.shared_expert) c.shared_expert_ffn = c.ffn;
  }
  if (!arch.layer_shapes) {
    c.head_dim_swa = c.n_kv_heads_swa = c.rope_dim_swa = c.shared_kv_layers = 0;
    c.layer_ffn.clear();
  }
  // Gemma 4's global layers' proportional RoPE on a quarter of each head (its
  // partial_rotary_factor 0.25): the first pairs' factors 1, the others' 1e30 (llama.cpp's
  // rope_freqs, which its gemma4 requires).
  if (arch.layer_shapes && !c.rope_scaling.active()) {
    const int64_t pairs = c.head_size() / 2;
    std::vector<float> factors(static_cast<size_t>(pairs), 1e30f);
    std::fill_n(factors.begin(), std::max<int64_t>(1, pairs / 4), 1.0f);
    c.rope_scaling = rope_scaling_of_factors(std::move(factors), c);
  }
  // Gemma 4 E2B's per-layer embeddings, scaled: a sixth of the width (at least 8).
  c.per_layer_dim = arch.per_layer_inputs ? std::max<int64_t>(8, c.d_model / 6 / 2 * 2) : 0;
  if (!arch.moe) c.n_experts = c.experts_used = 0;
  c.expert_ffn = 0;
  c.experts_gate_up_fused = c.k_as_v = false;
  if (!arch.shared_expert) c.shared_expert_ffn = 0;
  if (arch.linear_attention_step > 0) {
    // Qwen3.5's proportions: key heads half the query heads, value heads as many, each of the
    // attention head's width; RoPE on a quarter of each head.
    c.linear_key_heads = std::max<int64_t>(1, c.n_heads / 2);
    c.linear_value_heads = c.n_heads;
    c.linear_key_dim = c.linear_value_dim = c.head_size();
    c.linear_conv = 4;
    c.rope_dim = std::max<int64_t>(2, c.head_size() / 4 / 2 * 2);
  }
  return c;
}

}  // namespace cputrain
