// Low-rank adapters (LoRA) on a decoder's projections: y = W x + (alpha / rank) B (A x), with
// A (rank, in) and B (out, rank) trained and W frozen. Their parameters are the model's own
// ("layers.3.attention.wq.lora_a"), so the optimizer, checkpoints and the memory budget see them
// as any other.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "models/model_config.h"

namespace cputrain {

class ParameterSet;

// The projections of a block that can take an adapter, in Hugging Face's names: attention's (in
// a Gated DeltaNet layer q, k and v are its in_proj_qkv, o its out_proj; a gated attention's q
// holds its output gate), the MLP's (in a mixture of experts every expert's, an adapter each, and
// the shared expert's), Gated DeltaNet's z, beta and alpha projections, and a mixture's router.
enum class Projection { Q, K, V, O, Gate, Up, Down, Z, Beta, Alpha, Router };
inline constexpr int kProjectionCount = 11;
// "q", "k", "v", "o", "gate", "up", "down", "in_proj_z", "in_proj_b", "in_proj_a", "router".
std::string_view projection_name(Projection p);

struct LoraConfig {
  int64_t rank = 0;    // 0: no adapters
  double alpha = 0.0;  // the update's scale is alpha / rank
  std::array<bool, kProjectionCount> targets{};
  double dropout = 0.0;  // PEFT's lora_dropout on the update's input, in training only

  bool active() const { return rank > 0; }
  float scale() const { return static_cast<float>(alpha / static_cast<double>(rank)); }
  bool on(Projection p) const { return rank > 0 && targets[static_cast<size_t>(p)]; }
};

// "q,k,v,o,gate,up,down" (any subset, any order; "all" for every one but the router, which
// trains only where named; Phi-2's "dense", "fc1" and
// "fc2" for o, up and down; Qwen3.5's "in_proj_qkv" for q, k, v and "out_proj" for o) -> targets. A
// UserError naming `flag` and the unknown name, listing the known ones.
std::array<bool, kProjectionCount> parse_lora_targets(const std::string& list,
                                                      const std::string& flag);
// The targets as parse_lora_targets reads them: "q,k,v,o,gate,up,down".
std::string lora_targets_text(const std::array<bool, kProjectionCount>& targets);

// Whether a model of `config` has projection `p` (a gate in a gated MLP, Gated DeltaNet's z,
// beta and alpha in a model with its layers, a router in a mixture of experts).
bool has_projection(const ModelConfig& config, Projection p);
// The targets of `lora` that a model of `config` has, as lora_targets_text writes them.
std::string lora_targets_held(const ModelConfig& config, const LoraConfig& lora);
// The width of projection `p` of a model of `config`: the smaller of its input and output sizes
// (the narrowest over its layers' kinds), the most rank an adapter on it can use.
int64_t projection_width(const ModelConfig& config, Projection p);
// A UserError where `lora`'s rank is above the width of one of the projections it adapts, naming
// `flag` (as the user typed it), the rank and the narrowest such projection:
// "--lora-rank 100000: above the width of the q projection (64); at most 64". Nothing without
// adapters.
void check_lora_rank(const ModelConfig& config, const LoraConfig& lora, const std::string& flag);

// The A an adapter of `lora_a` ("layers.0.attention.wq.lora_a") uses in a model of `config`:
// itself, or where its architecture fuses the projection with others (q, k, v; gate, up) the
// fused projection's, which its parts share ("layers.0.attention.wqkv.lora_a").
std::string fused_lora_a(const ModelConfig& config, const std::string& lora_a);
// Whether `base` ("layers.0.feed_forward.experts.w13.") is the experts' gate and up in one
// parameter; the base of its part 0 (the gate, "....experts.w1.") or 1 (the up, "....experts.w3."),
// by which that part's adapter is named.
bool is_fused_experts(const std::string& base);
std::string fused_experts_part(const std::string& base, int part);
// A UserError naming `flag` where `lora` adapts some parts of a fused projection of the
// architecture but not the others ("--lora-targets q: phi3's q, k and v are one projection,
// qkv_proj: adapt all three or none"), or names a gate the architecture's MLP does not have (all
// seven, the default, adapt those it has). Nothing otherwise.
void check_lora_targets(const ModelConfig& config, const LoraConfig& lora, const std::string& flag);

// Whether a parameter name is an adapter's ("....lora_a" or "....lora_b").
bool is_lora_parameter(std::string_view name);

// What an adapter records of the base it was trained on, to refuse another: a hash of the
// model's shape and of its norm gains rounded to bf16. Norm gains differ between models of one
// shape (a base and its instruction-tuned sibling) but not between a model's files: GGUF keeps
// them F32 in every quantisation, so an adapter trained on a BF16 file applies to its Q4_K_M.
uint64_t base_fingerprint(const ModelConfig& config, const ParameterSet& params);
// 16 hex digits.
std::string fingerprint_text(uint64_t fingerprint);

// The adapters merged into their projections: every parameter of `merged` (a model of the same
// shape without adapters) gets the value of its namesake in `adapted`, a projection with an
// adapter W + (alpha / rank) B A.
void merge_lora(const ModelConfig& config, const ParameterSet& adapted, const LoraConfig& lora,
                const ParameterSet& merged);
// merge_lora's value of one parameter of `adapted` (not an adapter's) into `w` (its element
// count): W + (alpha / rank) B A for a projection with an adapter, W for any other. What a writer
// that merges as it writes, one tensor at a time, reads (tensor_names.h ValueReader).
void merged_values(const ModelConfig& config, const ParameterSet& adapted, const LoraConfig& lora,
                   int index, float* w);

}  // namespace cputrain
