// Differentiable ops on Variables. Each computes its forward with a kernel from kernels/ and,
// when a gradient is needed, records its backward right there (see autograd.h).
// Activations are (B, T, C) row-major; attention views (B, T, C) as (B, T, H, C / H).
#pragma once

#include "engine/autograd.h"

namespace cputrain {

// table (V, C), tokens (B, T) i32 -> (B, T, C).
Variable embedding(const Variable& table, const Tensor& tokens);
// x (..., K), w (N, K) -> x w^T (..., N).
Variable linear(const Variable& x, const Variable& w);
// x (..., C), w (C) -> x / sqrt(mean(x^2) + eps) * w.
Variable rmsnorm(const Variable& x, const Variable& w, float eps);
// x (B, T, C) seen as (B, T, H, D); table from kernels::rope_table with at least T rows.
Variable rope(const Variable& x, const Tensor& table, int64_t n_heads);
// q, k, v (B, T, C) -> causal softmax(q k^T / sqrt(D)) v per head, (B, T, C).
Variable attention(const Variable& q, const Variable& k, const Variable& v, int64_t n_heads);
// silu(gate) * up, elementwise.
Variable swiglu(const Variable& gate, const Variable& up);
// a + b, equal shapes.
Variable add(const Variable& a, const Variable& b);
// logits (..., V), targets i32 with numel = rows of logits -> mean cross-entropy, shape (1).
Variable cross_entropy(const Variable& logits, const Tensor& targets);

}  // namespace cputrain
