// The differentiable ops of a mixture-of-experts block (kernels/moe/): the router's choice of
// each token's k experts and their weights, and the experts' SwiGLU MLPs on the tokens routed to
// them, grouped by expert so that each expert's products are GEMMs over its rows.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/core/autograd.h"
#include "kernels/moe/moe_route.h"
#include "kernels/ops/swiglu.h"

namespace cputrain {

// Each token's experts (N, k, I32) and their weights (N, k), recorded for backward (the weights'
// gradient reaches the logits; the choice itself has none).
struct MoeRouting {
  Variable weights;
  Tensor experts;
};

// logits (..., E), FP32 -> the k experts of each of the N rows and their weights (MoeGating).
MoeRouting moe_route(const Variable& logits, int64_t k, kernels::MoeGating gating, bool normalize);

// The routing with each weight times its expert's output scale, scale (E) (Gemma 4's
// per-expert scale of the down product): the scale's gradient is each expert's sum over its
// rows of the weight times the weight's gradient.
MoeRouting moe_expert_scaled(const MoeRouting& route, const Variable& scale);

// x (..., C) -> sum over each row's k experts e of weight * w2[e] (silu(w1[e] x) * (w3[e] x)), of
// x's shape; w1, w3 (E, F, C), w2 (E, C, F); or w3 undefined and w1 (E, 2 F, C), each expert's
// gate rows and then its up rows (a GGUF file's ffn_gate_up_exps, read in place). The rows routed
// to an expert are gathered and each of its products is one GEMM over them (bf16 operands in bf16
// mode, FP32 sums); each product of a layer is one parallel pass over its experts, one expert a
// thread (its GEMM on that thread alone, packing its operands once), an expert with over half a
// thread's share of the rows split by output columns. The backward pass keeps x and the gate and up
// products (N k x F each: FP32; in bf16 mode their roundings and the activation's, as the dense MLP
// keeps them), and gives x, the weights, w1, w3 and w2 (where each wants it) their gradients.
//
// `lora`: low-rank adapters on any of the three products (models/lora.h), expert e's weight
// w[e] + scale b[e] a[e] with a (E, r, in) and b (E, out, r); each adapter's two products run
// inside its product's parallel pass. Its input takes PEFT's dropout where `dropout` > 0, each
// product's mask drawn from its own seed over the rows grouped by expert. The backward pass also
// keeps each adapter's scale (x a[e]^T) (N k x r).
struct MoeAdapters {
  Variable a1, b1, a3, b3, a2, b2;  // undefined where a product has none
  float scale = 1.0f;
  float dropout = 0.0f;
  uint64_t seed = 0;  // w1's mask; w3's and w2's are drawn from seeds derived from it
};
// `biases`: gpt-oss's, b1 and b3 (E, F) added to the gate and up products, b2 (E, C) to the
// down product's, each row its expert's (before the weight); undefined: none. `act`: the gated
// activation (kernels/ops/swiglu.h), SiluClamped for gpt-oss.
struct MoeBiases {
  Variable b1, b3, b2;
};
Variable moe_experts(const Variable& x, const Variable& w1, const Variable& w3, const Variable& w2,
                     const MoeRouting& route, const MoeAdapters& lora = {},
                     const MoeBiases& biases = {},
                     kernels::Activation act = kernels::Activation::Silu);

// The router's auxiliary losses (kernels::MoeRouterLosses) in training: while a
// MoeRouterLossScope lives, each Softmax routing recorded for the backward pass takes into its
// logits the gradient of balance_weight times its load-balancing loss plus z_weight times its
// z-loss (the trainer's coefficients times the micro-batch's share of the step). Set on the
// thread that runs the step; scopes nest.
class MoeRouterLossScope {
 public:
  MoeRouterLossScope(float balance_weight, float z_weight);
  ~MoeRouterLossScope();
  MoeRouterLossScope(const MoeRouterLossScope&) = delete;
  MoeRouterLossScope& operator=(const MoeRouterLossScope&) = delete;

 private:
  float balance_, z_;  // the enclosing scope's
};

// Each router's load, router by router in the order the routers ran (a model's MoE layers in
// order), over the forward passes run while a MoeLoadCount lives: a training step's
// micro-batches, not a checkpoint region's second forward in the backward pass, nor validation.
// Counted on the thread that runs the step, one count at a time.
struct MoeLoad {
  std::vector<int64_t> tokens;  // the tokens each expert took
  double balance = 0.0;         // the sums over the passes of its losses (Softmax gating)
  double z = 0.0;
  int64_t passes = 0;
  bool losses = false;  // whether its gating has router losses (Softmax), which were summed
};
class MoeLoadCount {
 public:
  MoeLoadCount();  // from the first router again
  ~MoeLoadCount();
  MoeLoadCount(const MoeLoadCount&) = delete;
  MoeLoadCount& operator=(const MoeLoadCount&) = delete;
};
// The loads so far, summed over the counts since the last take; then none.
std::vector<MoeLoad> moe_load_take();

// x (..., C), gate (..., 1) -> each row of x times sigmoid of its gate (a shared expert's output
// scaled by its own gate).
Variable row_sigmoid_gated(const Variable& x, const Variable& gate);

}  // namespace cputrain
