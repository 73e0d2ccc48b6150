// Configuration of the Llama-style decoder and the named presets of DESIGN.md.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace cputrain {

struct LlamaConfig {
  int64_t vocab = 16384;
  int64_t d_model = 256;
  int64_t n_layers = 6;
  int64_t n_heads = 8;
  int64_t ffn = 768;
  int64_t ctx = 256;
  float norm_eps = 1e-5f;
  double rope_theta = 10000.0;

  int64_t head_dim() const { return d_model / n_heads; }
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

// Number of trainable parameters: embedding and LM head V*C each, per layer 4 C^2 (attention)
// + 3 C F (SwiGLU) + 2 C (norms), and the final norm C.
int64_t parameter_count(const LlamaConfig& config);
// FLOPs of training on one token with sequences of ctx tokens: 6 x the parameters of the matrix
// products (the blocks' and the LM head's) plus 6 x layers x ctx x d_model for causal attention
// (scores and weighted sum, forward and backward). The numerator of MFU.
double training_flops_per_token(const LlamaConfig& config, int64_t ctx);

// Empty when valid, else what is wrong (naming the flag).
std::string validate(const LlamaConfig& config);

}  // namespace cputrain
