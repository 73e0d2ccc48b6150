// The tiny preset as another architecture of models/architecture.h, for the model tests: its
// parts (Phi-2's parallel block, LayerNorm, GELU MLP and biases; Gemma 3's q/k norms, post-norms
// and GeGLU), and where it has sliding-window layers, every other layer within 16 keys at a RoPE
// base of 100 (the others at 10,000) with the scores scaled by 0.3, so that the tiny context of
// 64 reaches past the window. Qwen3.5's, four layers: three Gated DeltaNet (2 key heads, 4 value
// heads of 16) and one attention with its output gate. A mixture of experts' (Qwen3-MoE,
// Qwen3.5-MoE): 8 experts of half the MLP's width, 2 a token. Gemma 4's: its windowed and global
// layers of two shapes, layers sharing keys and values, per-layer embeddings (below).
#pragma once

#include "models/architecture.h"
#include "models/model_config.h"

namespace cputrain::test {

inline ModelConfig tiny_as(const char* arch) {
  ModelConfig base = find_preset("tiny")->config;
  // A hybrid architecture's every kind of layer: Qwen3.5's DeltaNet, DeltaNet, DeltaNet,
  // attention.
  const Architecture& a = *find_architecture(arch);
  if (a.linear_attention_step > 0) base.n_layers = a.linear_attention_step;
  ModelConfig c = with_architecture(base, a);
  if (a.moe) {  // 8 experts, 2 a token (and Qwen3.5-MoE's shared expert), each half the MLP
    c.ffn /= 2;
    c.n_experts = 8;
    c.experts_used = 2;
    if (a.shared_expert) c.shared_expert_ffn = c.ffn;
  }
  if (c.swa_pattern > 0) {
    c.sliding_window = 16;
    c.swa_pattern = 2;
    c.rope_theta_swa = 100.0;
    c.attn_scale = 0.3f;
  }
  if (a.layer_shapes) {
    // Gemma 4 E2B's parts: six layers, the windowed ones with heads of 8 (2 key/value heads),
    // the global ones of 16 (1) with RoPE on a quarter of their pairs (factors of 1e30 on the
    // others); the last two reading layers 2 and 3's keys and values, their MLPs twice as wide.
    c.n_layers = 6;
    c.head_dim_swa = c.head_size() / 2;
    c.n_kv_heads = 1;
    c.n_kv_heads_swa = 2;
    c.shared_kv_layers = 2;
    c.layer_ffn = {c.ffn, c.ffn, c.ffn, c.ffn, 2 * c.ffn, 2 * c.ffn};
    c.rope_scaling.type = "factors";
    c.rope_scaling.freq_factors.assign(static_cast<size_t>(c.rope_dims() / 2), 1e30f);
    c.rope_scaling.freq_factors[0] = c.rope_scaling.freq_factors[1] = 1.0f;
    c.final_softcap = 5.0f;
  }
  return c;
}

// Gemma 4 26B-A4B's and 31B's parts on the tiny Gemma 4: 4 GELU experts of 16 beside each
// dense MLP, 2 a token; the global layers that compute keys taking k as v (layers 1 and 3).
inline ModelConfig tiny_gemma4_experts() {
  ModelConfig c = tiny_as("gemma4");
  c.n_experts = 4;
  c.experts_used = 2;
  c.expert_ffn = 16;
  c.k_as_v = true;
  return c;
}

}  // namespace cputrain::test
