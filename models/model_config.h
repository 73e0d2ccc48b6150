// Configuration of the Llama-style decoder and the named presets of DESIGN.md.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace cputrain {

// Which elements of a head RoPE rotates together. Adjacent: (x[2j], x[2j+1]), llama.cpp's
// "normal" RoPE (Llama GGUFs, the presets). HalfSplit: (x[j], x[j + D/2]), llama.cpp's "neox"
// RoPE and Hugging Face's rotate_half (Qwen2).
enum class RopePairs { Adjacent, HalfSplit };
std::string_view rope_pairs_name(RopePairs pairs);  // "adjacent", "half-split"

// Gradient checkpointing (--checkpoint), from most memory to least: none (every block's
// activations kept for backward); mlp (of each block's MLP, its norm, projections and activation,
// only the input is kept, and the backward pass recomputes it; attention's activations, which
// cost the most to recompute, are kept); layer (each block's input alone kept, the block
// recomputed whole).
enum class Checkpointing { None, Mlp, Layer };
std::string_view checkpointing_name(Checkpointing level);  // "none", "mlp", "layer"
std::optional<Checkpointing> parse_checkpointing(std::string_view name);
// How the budget table and log lines say it: "none", "mlp", "per layer".
std::string_view checkpointing_words(Checkpointing level);

// RoPE scaling: each of a head's R/2 frequencies (R the rotated dimensions) divided by a factor,
// as llama.cpp's rope_freqs tensor holds them. `type` names where they come from: "llama3"
// (Llama 3.1/3.2's rope_scaling, whose four numbers give the factors), "longrope" (Phi-3's: short
// factors within the original context, long ones beyond, and a scale of the rotation), "linear"
// (every frequency divided by `factor`, positions by it: Gemma 3 4B and larger), or "factors" (a
// GGUF file's rope_freqs whose numbers are not known); empty: none. With sliding-window layers,
// only the global layers are scaled (Gemma 3's; llama.cpp's freq_scale_swa of 1).
struct RopeScaling {
  std::string type;
  double factor = 0.0;            // llama3: the longest wavelengths' divisor; linear: all's
  double low_freq_factor = 0.0;   // llama3: original context / low_freq_factor: that wavelength on
  double high_freq_factor = 0.0;  // llama3: original context / high_freq_factor: none below
  int64_t original_ctx = 0;       // llama3, longrope: the context of the unscaled model
  std::vector<float> freq_factors;  // R/2 divisors (longrope: the short factors)
  std::vector<float> long_factors;  // longrope: R/2 divisors where ctx > original_ctx
  double attn_factor = 1.0;         // longrope, yarn: cos and sin scaled by it
  double beta_fast = 0.0;           // yarn: the rotations per original context that bound the
  double beta_slow = 0.0;           // blend of extrapolated and interpolated frequencies
  bool truncate = true;             // yarn: those bounds rounded out to whole dimensions

  bool active() const { return !type.empty(); }
  // Whether the windowed layers are scaled too (yarn, gpt-oss's; else the global layers alone).
  bool every_layer() const { return type == "yarn"; }
};

// YaRN's factors (gpt-oss, "yarn"), as llama.cpp and Transformers compute them: pair j of R/2
// keeps its frequency below the dimension where a wavelength fits beta_fast times in the original
// context, takes it divided by `factor` above the one where it fits beta_slow times, a linear
// blend between, those dimensions rounded out to whole ones where `truncate` (llama.cpp always;
// Transformers unless the config says truncate false, as gpt-oss's does); cos and sin are scaled
// by 1 + 0.1 ln factor.
RopeScaling yarn_rope_scaling(double theta, int64_t rope_dims, double factor, int64_t original_ctx,
                              double beta_fast, double beta_slow, bool truncate = true);
// YaRN's own scale of cos and sin: 1 + 0.1 ln factor (1 for a factor of at most 1).
double yarn_attn_factor(double factor);

// Llama 3's factors: wavelengths below original_ctx / high_freq_factor keep their frequency,
// those above original_ctx / low_freq_factor are divided by `factor`, and those between by a
// blend of the two (Hugging Face's _compute_llama3_parameters, as factors of each frequency).
std::vector<float> llama3_freq_factors(double theta, int64_t head_dim, double factor,
                                       double low_freq_factor, double high_freq_factor,
                                       int64_t original_ctx);

struct ModelConfig;
// M-RoPE's first three sections (Qwen3.5's files) for `pairs` rotated pairs: text gives each the
// same position, so a split over the three that reaches every pair rotates as plain RoPE does
// (Qwen3.5's own 11, 11, 10 of 32).
std::array<int64_t, 3> text_mrope_sections(int64_t pairs);
// Linear RoPE scaling by `factor` of a head rotating `rope_dims` dimensions.
RopeScaling linear_rope_scaling(double factor, int64_t rope_dims);

// RoPE scaling of a model of `config` (theta, head size) from its factors alone (a GGUF file's
// rope_freqs): "llama3" with its four numbers where Llama 3's published settings (low and high
// frequency factors 1 and 4, the largest factor as `factor`, an original context of a power of 2)
// give these factors to the float, else "factors".
RopeScaling rope_scaling_of_factors(std::vector<float> factors, const ModelConfig& config);

struct ModelConfig {
  // The architecture (models/architecture.h) whose description the model follows: its parts,
  // its names in GGUF and Hugging Face files.
  std::string architecture = "llama";
  int64_t vocab = 16384;
  int64_t d_model = 256;
  int64_t n_layers = 6;
  int64_t n_heads = 8;  // query heads
  // Key/value heads: n_heads for multi-head attention, fewer for grouped-query attention
  // (n_heads a multiple of it; 1 is multi-query). 0 means n_heads.
  int64_t n_kv_heads = 0;
  // Width of one head; 0 means d_model / n_heads.
  int64_t head_dim = 0;
  int64_t ffn = 768;
  int64_t ctx = 256;
  float norm_eps = 1e-5f;  // RMSNorm epsilon
  double rope_theta = 10000.0;
  RopePairs rope_pairs = RopePairs::Adjacent;
  bool qkv_bias = false;  // the q, k and v projections have biases
  // Its GGUF file holds q, k and v (and their biases) in one tensor, attn_qkv, in a family whose
  // llama.cpp loader reads either form (Phi-2 converted from its original checkpoint): split on
  // reading and fused again on writing, and adapters on q, k and v share one A, as llama.cpp
  // adapts the one tensor. Phi-3's are fused in every file (Architecture::fused_qkv).
  bool qkv_fused = false;
  bool tie_embeddings = false;  // the LM head is the token embedding matrix
  bool qk_norm = false;         // RMSNorm of each head of q and k before RoPE (Qwen3)
  RopeScaling rope_scaling;
  // The dimensions of each head RoPE rotates, its first (even); 0 means all (head_size()).
  int64_t rope_dim = 0;
  // Layers (from 0) that apply no RoPE (SmolLM3's every fourth); empty: all apply it.
  std::vector<int64_t> no_rope_layers;
  // The RMSNorm gains are held as w where the norm scales by 1 + w, as Gemma's Hugging Face files
  // hold them; false: as the gains themselves (GGUF files, which hold 1 + w, and new models).
  bool norm_plus_one = false;
  // Sliding-window layers (Gemma 2 and 3): with a window, layer i attends the `sliding_window`
  // keys up to each query where i % swa_pattern < swa_pattern - 1 (Gemma 3's five of every six,
  // Gemma 2's every other), every key before it in the others; their RoPE base rope_theta_swa
  // (0: rope_theta). 0: no window.
  int64_t sliding_window = 0;
  int64_t swa_pattern = 0;
  double rope_theta_swa = 0.0;
  // The attention scores' scale; 0: 1 / sqrt(head_size()).
  float attn_scale = 0.0f;
  // Soft-capping, cap * tanh(x / cap), of the attention scores and of the final logits (Gemma
  // 2's 50 and 30); 0: none.
  float attn_softcap = 0.0f;
  float final_softcap = 0.0f;
  // Gated DeltaNet layers (Qwen3.5's linear attention, kernels/deltanet/): the layers (from 0)
  // that are, the others full attention; empty: none. Their q and k have linear_key_heads heads
  // of linear_key_dim, v linear_value_heads (a multiple) of linear_value_dim; each of q, k and v
  // passes a causal convolution of linear_conv taps.
  std::vector<int64_t> linear_layers;
  int64_t linear_key_heads = 0;
  int64_t linear_value_heads = 0;
  int64_t linear_key_dim = 0;
  int64_t linear_value_dim = 0;
  int64_t linear_conv = 4;
  // Full attention's output times sigmoid of a gate, a projection of the block's input of q's
  // width (Qwen3.5's, which its files hold beside each head's query in attn_q).
  bool attn_output_gate = false;
  // A mixture of experts in every block's MLP place (Qwen3-MoE): n_experts SwiGLU experts, each
  // of width ffn, of which a router (the architecture's gating, engine/core/moe_ops.h) chooses
  // experts_used for each token and weighs them, the weights renormalised to sum 1 where
  // expert_weights_norm; 0 experts: a dense MLP.
  int64_t n_experts = 0;
  int64_t experts_used = 0;
  bool expert_weights_norm = true;
  // A shared expert beside them (Qwen3.5-MoE): a SwiGLU MLP of this width that every token takes,
  // its output times sigmoid of a projection of the token to one number; 0: none.
  int64_t shared_expert_ffn = 0;
  // The experts' width where each block keeps a dense MLP of width ffn beside them (Gemma 4
  // 26B-A4B: the experts on a norm of their own and the router on the unnormed residual, each
  // expert's output scaled by a learnt factor, the two outputs normed and added); 0: the experts
  // take the MLP's place, each of width ffn.
  int64_t expert_ffn = 0;
  // A GGUF file's experts' gate and up in one tensor (ffn_gate_up_exps: each expert's gate rows,
  // then its up rows), as Gemma 4's converter writes them: one parameter of the model
  // (feed_forward.experts.w13), read in place and written back so.
  bool experts_gate_up_fused = false;
  // The global layers that compute keys have no v projection: v is k's projection before k's
  // norm and RoPE (Gemma 4 31B's attention_k_eq_v).
  bool k_as_v = false;
  // Gemma 4's windowed layers' own attention: their head size, key/value heads and rotated
  // dimensions (0: the global layers' head_dim, n_kv_heads and rope_dim).
  int64_t head_dim_swa = 0;
  int64_t n_kv_heads_swa = 0;
  int64_t rope_dim_swa = 0;
  // Each layer's MLP width where the layers differ (Gemma 4 E2B's shared-KV layers are twice as
  // wide); empty: ffn in every layer.
  std::vector<int64_t> layer_ffn;
  // The last shared_kv_layers layers compute no keys and values of their own: each attends with
  // those of an earlier layer of its kind (kv_layer), as Gemma 4's do; 0: none.
  int64_t shared_kv_layers = 0;
  // Per-layer embeddings (Gemma 4 E2B, E4B): each layer takes an input of this width from a
  // table of its own per token and a projection of the embedding; 0: none.
  int64_t per_layer_dim = 0;

  int64_t kv_heads() const { return n_kv_heads > 0 ? n_kv_heads : n_heads; }
  int64_t head_size() const { return head_dim > 0 ? head_dim : d_model / n_heads; }
  int64_t q_dim() const { return n_heads * head_size(); }      // rows of wq, columns of wo
  int64_t kv_dim() const { return kv_heads() * head_size(); }  // rows of wk and wv
  int64_t rope_dims() const { return rope_dim > 0 ? rope_dim : head_size(); }
  // The same of layer `layer`: a windowed layer's own where the model gives them.
  int64_t kv_heads(int64_t layer) const {
    return n_kv_heads_swa > 0 && windowed_layer(layer) ? n_kv_heads_swa : kv_heads();
  }
  // The windowed layers' head size: their own, else head_size().
  int64_t head_size_swa() const { return head_dim_swa > 0 ? head_dim_swa : head_size(); }
  int64_t head_size(int64_t layer) const {
    return windowed_layer(layer) ? head_size_swa() : head_size();
  }
  int64_t q_dim(int64_t layer) const { return n_heads * head_size(layer); }
  int64_t kv_dim(int64_t layer) const { return kv_heads(layer) * head_size(layer); }
  int64_t rope_dims(int64_t layer) const;
  // The windowed layers' rotated dimensions (rope_dims() where they have no head size of their
  // own).
  int64_t rope_dims_swa() const;
  int64_t ffn_width(int64_t layer) const {
    return layer_ffn.empty() ? ffn : layer_ffn[static_cast<size_t>(layer)];
  }
  // The layer whose keys and values layer `layer` attends with: itself, or for a shared-KV
  // layer the last of its kind before them (llama.cpp's: the one two before the first shared
  // layer where windowed, the one just before it where global).
  int64_t kv_layer(int64_t layer) const;
  // Whether the model's layers differ in their attention's or MLP's shape.
  bool layers_differ() const {
    return head_dim_swa > 0 || n_kv_heads_swa > 0 || rope_dim_swa > 0 || !layer_ffn.empty() ||
           shared_kv_layers > 0;
  }
  bool rope_in_layer(int64_t layer) const;
  // Whether layer `layer` is Gated DeltaNet rather than attention.
  bool linear_layer(int64_t layer) const;
  bool moe() const { return n_experts > 0; }
  // Whether each block has a dense MLP beside its experts (expert_ffn), and the experts' width.
  bool experts_beside_mlp() const { return moe() && expert_ffn > 0; }
  int64_t expert_width() const { return expert_ffn > 0 ? expert_ffn : ffn; }
  // Whether layer `layer` computes a v projection of its own: not a shared-KV layer, nor a
  // global layer of a model whose global layers take k as v.
  bool own_v(int64_t layer) const {
    return kv_layer(layer) == layer && !(k_as_v && !windowed_layer(layer));
  }
  int64_t linear_qk_dim() const { return linear_key_heads * linear_key_dim; }     // q's, k's width
  int64_t linear_v_dim() const { return linear_value_heads * linear_value_dim; }  // v's, z's
  // Whether layer `layer` attends within the sliding window.
  bool windowed_layer(int64_t layer) const {
    return sliding_window > 0 && swa_pattern > 0 && layer % swa_pattern < swa_pattern - 1;
  }
  // Whether the windowed layers rotate by a table of their own: at a RoPE base of their own
  // (rope_swa_theta()), or unscaled where the global layers are scaled.
  bool rope_swa_apart() const {
    return (rope_theta_swa > 0.0 && rope_theta_swa != rope_theta) ||
           (sliding_window > 0 && swa_pattern > 0 && rope_dims_swa() != rope_dims()) ||
           (sliding_window > 0 && swa_pattern > 0 && rope_scaling.active() &&
            !rope_scaling.every_layer());
  }
  double rope_swa_theta() const { return rope_theta_swa > 0.0 ? rope_theta_swa : rope_theta; }
  // What the RMSNorms add to their held weights: 1 with norm_plus_one, else 0.
  float norm_offset() const { return norm_plus_one ? 1.0f : 0.0f; }
  // The divisors of the RoPE frequencies at this ctx (rope_scaling's, the long ones of longrope
  // beyond its original context), or null without scaling.
  const float* rope_freq_factors() const;
};

struct Preset {
  std::string name;
  ModelConfig config;
  int64_t batch = 8;  // default micro-batch
  int64_t accum = 1;  // default gradient-accumulation steps
};

// tiny, mini, mega, behemoth, titan; nullopt for anything else.
std::optional<Preset> find_preset(const std::string& name);
std::vector<std::string> preset_names();

// Number of parameters: the embedding V*C, the LM head V*C unless tied; per layer wq and wo
// 2 C q_dim, wk and wv 2 C kv_dim (plus q_dim + 2 kv_dim biases), 3 C F (SwiGLU; 2 C F without a
// gate) and 2 C (norms; C for one norm, twice with LayerNorm's biases, 2 C more with post-norms;
// plus the o, up and down
// biases where the architecture has them; with experts, E (3 C F) and the router's E C in the
// MLP's place, and a shared expert's 3 C Fs + C, gpt-oss's router and expert biases E (1 + 2 F +
// C), its sinks H; experts beside a dense MLP (expert_ffn) keep the MLP and add the router's
// scale C, the experts' output scales E and three norms 3 C; no wv (nor its bias) where a layer
// takes k as v); the final norm C (2 C), the head's bias V.
int64_t parameter_count(const ModelConfig& config);
// FLOPs of training on one token with sequences of ctx tokens: 6 x the parameters of the matrix
// products (the blocks' and the LM head's) plus 6 x layers x ctx x q_dim for causal attention
// (scores and weighted sum, forward and backward); with experts, the router's and the
// experts_used experts' products a token computes. The numerator of MFU.
double training_flops_per_token(const ModelConfig& config, int64_t ctx);

// What is wrong with a configuration, in the config's own terms: `field` (a ModelConfig member
// name) holds `value`, which `problem` describes; where the problem is a relation to another
// field, `other` names it and `other_value` is its value.
struct ConfigProblem {
  std::string field;
  std::string value;
  std::string problem;
  std::string other;
  std::string other_value;
  // "field value problem [other other_value]", e.g. "d_model 100 is not a multiple of n_heads 3".
  std::string str() const;
};
std::optional<ConfigProblem> validate(const ModelConfig& config);

}  // namespace cputrain
