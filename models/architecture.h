// The architectures cputrain computes, each one description: its names in GGUF and Hugging Face
// files, the parts of its block, the RoPE it applies, and the keys of its files it reads. The
// decoder (models/decoder.h), the readers and writers of model files (gguf_model.h, hf_config.h,
// hf_writer.h) and `inspect` take an architecture's parts from here; a family whose parts are all
// known is a row of the table in architecture.cpp.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kernels/moe/moe_route.h"
#include "kernels/ops/swiglu.h"
#include "models/model_config.h"

namespace cputrain {

// Whether a part is in every model of an architecture, in none, or in those whose files have it.
enum class Presence { Never, Optional, Always };

// The MLP of a block: silu(gate) * up (SwiGLU) or gelu(gate) * up with GELU's tanh approximation
// (GeGLU), each then the down projection; or gelu(up) alone then down, without a gate (Phi-2's
// fc1, GELU, fc2).
enum class Mlp { SwiGlu, GeGlu, Gelu };
std::string_view mlp_name(Mlp mlp);  // "SwiGLU", "GeGLU", "GELU"
// The norms of a block and the final one: RMSNorm, or LayerNorm with a bias.
enum class Norm { RmsNorm, LayerNorm };

struct Architecture {
  // The config's architecture and the GGUF general.architecture ("qwen3").
  std::string_view name;
  // Hugging Face config.json's model_type values it reads; the first is the one written.
  std::vector<std::string_view> hf_model_types;
  // The model_type values of image-and-text folders whose text model it reads (text_config;
  // tensors model.language_model.*, the vision model's left out): Qwen3.5's published
  // checkpoints ("qwen3_5").
  std::vector<std::string_view> hf_multimodal_types;
  // config.json's "architectures" written on export ("Qwen3ForCausalLM").
  std::string_view hf_class;
  // The pairing of RoPE's elements llama.cpp applies to it (its rope type: NORM adjacent, NEOX
  // half-split), which the q and k rows of its GGUF files are in. Hugging Face files are always
  // half-split (rotate_half).
  RopePairs gguf_rope_pairs = RopePairs::Adjacent;
  // Biases on the q, k and v projections.
  Presence qkv_bias = Presence::Never;
  // Per-head RMSNorm of q and k before RoPE ("attn_q_norm", "q_norm").
  bool qk_norm = false;
  // The q, k and v rows in one tensor ("attn_qkv", "self_attn.qkv_proj"), and the gate and up
  // rows in one ("ffn_up", "mlp.gate_up_proj"), in that order: split into the decoder's
  // projections on reading, fused again on writing. An adapter on a fused projection is one A
  // and one B whose rows are its parts' (the decoder's projections share the A).
  bool fused_qkv = false;
  bool fused_gate_up = false;
  // RoPE on the first dimensions of each head only (partial_rotary_factor; GGUF
  // rope.dimension_count below the head dimension).
  bool partial_rotary = false;
  // RoPE scaling types it reads ("llama3"); others are refused.
  std::vector<std::string_view> rope_scalings;
  // Every step-th layer (counted from 1) applies no RoPE; 0: every layer applies it.
  int64_t no_rope_layer_step = 0;
  Mlp mlp = Mlp::SwiGlu;
  Norm norm = Norm::RmsNorm;
  // Attention and the MLP both from the one norm of the block's input, their outputs added to the
  // residual together (Phi-2); else the MLP from a second norm after attention's residual.
  bool parallel_block = false;
  // Biases on the output, up and down projections and on the head, beside q/k/v's (Phi-2).
  bool dense_biases = false;
  // A norm of attention's output and of the MLP's before each joins the residual (Gemma 2, 3).
  bool post_norms = false;
  // Its layers may attend within a sliding window (ModelConfig::sliding_window), every
  // swa_pattern-th (from 1) attending every key; the default pattern of its files, the window
  // where its files give none (Hugging Face's default; `train --arch` takes it; 0: none), and the
  // windowed layers' RoPE base where they do not give it (0: the model's).
  int64_t swa_pattern = 0;
  int64_t default_window = 0;
  double default_rope_theta_swa = 0.0;
  // Soft-capping of the attention scores and the final logits where its files do not give them
  // (Gemma 2's 50 and 30); 0: none unless given. Whether it reads an attention cap at all.
  float default_attn_softcap = 0.0f;
  float default_final_softcap = 0.0f;
  bool attn_softcap = false;
  // The layer count of its model whose scores llama.cpp scales by d_model / heads rather than the
  // head dimension (Gemma 2 and 3 27B: Hugging Face's query_pre_attn_scalar); 0: none.
  int64_t width_scaled_layers = 0;
  // Hugging Face names of its own for parameters, by the decoder's name less the layer prefix
  // and the ".weight" / ".bias" ("attention.wo" -> "self_attn.dense"; the final "norm" ->
  // "model.final_layernorm", a name of the whole model); the others are Llama's.
  std::vector<std::pair<std::string_view, std::string_view>> hf_names;
  // The token embeddings are scaled by sqrt(d_model) on the way in (not on the tied head's way
  // out).
  bool scale_embeddings = false;
  // Its Hugging Face files hold each RMSNorm's gain less 1 (the norm scales by 1 + w); its GGUF
  // files hold the gain (llama.cpp's converter adds the 1). ModelConfig::norm_plus_one says which
  // a model holds.
  bool hf_norm_plus_one = false;
  // Always a tied head: the files hold no output tensor.
  bool always_tied = false;
  // Every linear_attention_step-th layer (from 1) is full attention and the others Gated
  // DeltaNet (Qwen3.5's three of every four; ModelConfig::linear_layers); 0: none.
  int64_t linear_attention_step = 0;
  // Full attention's output gated by a sigmoid (ModelConfig::attn_output_gate).
  bool attn_output_gate = false;
  // A mixture of experts in place of every block's MLP (ModelConfig::n_experts), its router's
  // gating (kernels/moe/moe_route.h).
  bool moe = false;
  kernels::MoeGating moe_gating = kernels::MoeGating::Softmax;
  // A shared expert beside the experts (ModelConfig::shared_expert_ffn).
  bool shared_expert = false;
  // Biases on the router and on each expert's gate, up and down products, and the experts'
  // gated activation (gpt-oss's clamped SwiGLU).
  bool moe_biases = false;
  kernels::Activation moe_activation = kernels::Activation::Silu;
  // A bias on attention's output projection (without dense_biases' others), and each head's
  // attention sink (kernels/attention/attention.h), gpt-oss's.
  bool attn_out_bias = false;
  bool attn_sinks = false;
  // Its Hugging Face files hold each layer's experts as gpt-oss's do: gate_up_proj [E, C, 2 F]
  // (x times it; each expert's gate and up columns alternating), down_proj [E, F, C], biases
  // gate_up_proj_bias and down_proj_bias; the experts' count num_local_experts, their width
  // intermediate_size.
  bool hf_gpt_oss_experts = false;
  // Gemma 4's attention: v normed per head without a gain, scores unscaled (a scale of 1, the
  // q and k norms standing in for it).
  bool v_norm = false;
  bool unscaled_scores = false;
  // A learnt scalar multiplying each layer's output, its residual included (Gemma 4's
  // layer_scalar).
  bool layer_output_scale = false;
  // Layers that differ in shape (ModelConfig::layers_differ: the windowed layers' own head size,
  // key/value heads and rotation, MLP widths per layer, layers sharing another's keys and values)
  // and per-layer embeddings (ModelConfig::per_layer_dim), Gemma 4's.
  bool layer_shapes = false;
  bool per_layer_inputs = false;
  // Experts beside each block's dense MLP where its files have them (ModelConfig::expert_ffn:
  // Gemma 4 26B-A4B's), GELU-gated; global layers taking k as v where its files give them no
  // attn_v (ModelConfig::k_as_v: Gemma 4 31B's).
  bool experts_beside_mlp = false;
  bool k_as_v = false;
  // Whether its GGUF and Hugging Face files are read and written; where not, `train --arch`
  // trains one and its run's checkpoint holds it, and a file of it is refused in one line, but
  // for a whole model read and written as GGUF where gguf_written says so.
  bool files = true;
  bool gguf_written = true;
  // GGUF names of its own for parameters, as hf_names ("ffn_norm" -> "post_attention_norm").
  std::vector<std::pair<std::string_view, std::string_view>> gguf_names;
  // The keys of its config.json beyond those every architecture reads (architecture.cpp), read or
  // known to change nothing cputrain computes; a key in neither list is refused (hf_key_known).
  std::vector<std::string_view> hf_keys;
  // The keys "<name>.<key>" of its GGUF files beyond those every architecture has that it reads
  // ("attention.sliding_window"); a key in neither is refused.
  std::vector<std::string_view> gguf_keys;
  // One line for `inspect` and --help: the parts that set it apart.
  std::string_view summary;
};

// Every architecture, in the order the help lists them.
const std::vector<Architecture>& architectures();
// The architecture named `name` (GGUF general.architecture, or ModelConfig::architecture); null
// where there is none.
const Architecture* find_architecture(std::string_view name);
// The architecture of Hugging Face model_type `type`; null where none reads it.
const Architecture* find_hf_architecture(std::string_view type);
// The config's architecture; std::invalid_argument where it names none.
const Architecture& architecture_of(const ModelConfig& config);
// "llama, qwen2, qwen3, phi3, smollm3".
std::string architecture_names();
// Those of them with a mixture of experts ("qwen3moe, ..."), the same way.
std::string expert_architecture_names();
// Whether config.json key `key` is one cputrain reads, or knows to change nothing it computes,
// for a model of `arch` (keys from "_", such as _name_or_path, are notes of the tools).
bool hf_key_known(const Architecture& arch, std::string_view key);
// "llama, mistral, phi3, qwen2, qwen3, smollm3".
std::string hf_model_type_names();
// The RoPE scaling types every architecture reads, for messages: "llama3".
std::string rope_scaling_names(const Architecture& arch);

// What in `config` its architecture does not have: "qkv_bias is not part of qwen3" (q/k/v biases
// where it has none, none where it always has them, q/k norms where it has none or none where it
// has them, a RoPE scaling it does not apply, layers without RoPE other than its own); empty
// where the config is one of its models.
std::string architecture_mismatch(const ModelConfig& config);

// A configuration of architecture `arch` with its parts (biases where always present, q/k norms,
// its GGUF's RoPE pairing), the rest as `config`: what `train --arch` starts from.
ModelConfig with_architecture(ModelConfig config, const Architecture& arch);

// Why a model of `c` takes no router losses (kernels::MoeRouterLosses): it has no experts, or
// its router (gpt-oss's, top k then softmax) has no probabilities over all of them to balance;
// empty where it takes them.
std::string router_losses_refusal(const ModelConfig& c);

// A UserError where `arch`'s files are neither read nor written (Architecture::files): `what`
// says what was asked ("path: reading", "writing GGUF").
void require_files(const Architecture& arch, const std::string& what);

// The Gated DeltaNet layers of a model of `arch` with `layers` layers (all but every
// linear_attention_step-th; none where it has none).
std::vector<int64_t> step_linear_layers(const Architecture& arch, int64_t layers);
// All of `layers` layers but every `interval`-th (from 1): a file's full_attention_interval.
std::vector<int64_t> linear_layers_between(int64_t interval, int64_t layers);

// The layers without RoPE of a model of `arch` with `layers` layers (every no_rope_layer_step-th).
std::vector<int64_t> step_no_rope_layers(const Architecture& arch, int64_t layers);

}  // namespace cputrain
