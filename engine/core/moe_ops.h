// The differentiable ops of a mixture-of-experts block (kernels/moe/): the router's choice of
// each token's k experts and their weights, and the experts' SwiGLU MLPs on the tokens routed to
// them, grouped by expert so that each expert's products are GEMMs over its rows.
#pragma once

#include <cstdint>

#include "engine/core/autograd.h"
#include "kernels/moe/moe_route.h"

namespace cputrain {

// Each token's experts (N, k, I32) and their weights (N, k), recorded for backward (the weights'
// gradient reaches the logits; the choice itself has none).
struct MoeRouting {
  Variable weights;
  Tensor experts;
};

// logits (..., E), FP32 -> the k experts of each of the N rows and their weights (MoeGating).
MoeRouting moe_route(const Variable& logits, int64_t k, kernels::MoeGating gating, bool normalize);

// x (..., C) -> sum over each row's k experts e of weight * w2[e] (silu(w1[e] x) * (w3[e] x)), of
// x's shape; w1, w3 (E, F, C), w2 (E, C, F). The rows routed to an expert are gathered and each
// of its products is one GEMM over them (bf16 operands in bf16 mode, FP32 sums); each product
// of a layer is one parallel pass over its experts, one expert a thread (its GEMM on that thread
// alone, packing its operands once), an expert with over half a thread's share of the rows split
// by output columns. The backward pass keeps x and the gate and up products (N k x F each: FP32;
// in bf16 mode their roundings and the activation's, as the dense MLP keeps them), and gives x,
// the weights, w1, w3 and w2 (where each wants it) their gradients.
Variable moe_experts(const Variable& x, const Variable& w1, const Variable& w3, const Variable& w2,
                     const MoeRouting& route);

// x (..., C), gate (..., 1) -> each row of x times sigmoid of its gate (a shared expert's output
// scaled by its own gate).
Variable row_sigmoid_gated(const Variable& x, const Variable& gate);

}  // namespace cputrain
