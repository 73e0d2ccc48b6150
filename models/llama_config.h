// Configuration of the Llama-style decoder and the named presets of DESIGN.md.
#pragma once

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

struct LlamaConfig {
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
  bool qkv_bias = false;        // the q, k and v projections have biases
  bool tie_embeddings = false;  // the LM head is the token embedding matrix

  int64_t kv_heads() const { return n_kv_heads > 0 ? n_kv_heads : n_heads; }
  int64_t head_size() const { return head_dim > 0 ? head_dim : d_model / n_heads; }
  int64_t q_dim() const { return n_heads * head_size(); }      // rows of wq, columns of wo
  int64_t kv_dim() const { return kv_heads() * head_size(); }  // rows of wk and wv
};

struct Preset {
  std::string name;
  LlamaConfig config;
  int64_t batch = 8;  // default micro-batch
  int64_t accum = 1;  // default gradient-accumulation steps
};

// tiny, mini, mega, behemoth, titan; nullopt for anything else.
std::optional<Preset> find_preset(const std::string& name);
std::vector<std::string> preset_names();

// Number of parameters: the embedding V*C, the LM head V*C unless tied; per layer wq and wo
// 2 C q_dim, wk and wv 2 C kv_dim (plus q_dim + 2 kv_dim biases), 3 C F (SwiGLU) and 2 C (norms);
// the final norm C.
int64_t parameter_count(const LlamaConfig& config);
// FLOPs of training on one token with sequences of ctx tokens: 6 x the parameters of the matrix
// products (the blocks' and the LM head's) plus 6 x layers x ctx x q_dim for causal attention
// (scores and weighted sum, forward and backward). The numerator of MFU.
double training_flops_per_token(const LlamaConfig& config, int64_t ctx);

// What is wrong with a configuration, in the config's own terms: `field` (a LlamaConfig member
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
std::optional<ConfigProblem> validate(const LlamaConfig& config);

}  // namespace cputrain
