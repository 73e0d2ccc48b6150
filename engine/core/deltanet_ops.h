// The differentiable ops of Qwen3.5's layers beside those of ops.h: Gated DeltaNet's causal
// convolution, L2-normalised heads, decay, delta rule and gated RMSNorm, and the sigmoid gate of
// its full attention. Activations (B, T, C); every op computes on FP32 values in either compute
// mode and saves what it reads in FP32 (kernels/deltanet/).
#pragma once

#include <cstdint>

#include "engine/core/autograd.h"

namespace cputrain {

// x (B, T, C), w (C, K) -> silu of each channel's causal convolution with its K taps over the
// positions before (zeros before the first), (B, T, C). Decoding, without gradients: `state`
// (B, C, K - 1), the inputs before x, is read and replaced by those before what follows x.
// Packed rows: `positions` (B, T, I32), each position's index within its sequence, and each
// sequence's windows read zeros before its start (undefined: one sequence a row).
Variable causal_conv_silu(const Variable& x, const Variable& w, Tensor* state = nullptr,
                          const Tensor& positions = Tensor());
// x (..., H * D) -> each head of D divided by sqrt(sum of its squares + eps).
Variable head_l2norm(const Variable& x, int64_t heads, float eps);
// a (B, T, H), a_log (H), dt_bias (H) -> the log decay -exp(a_log) softplus(a + dt_bias).
Variable deltanet_decay(const Variable& a, const Variable& a_log, const Variable& dt_bias);
// sigmoid(x), elementwise.
Variable sigmoid(const Variable& x);
// x * sigmoid(gate), equal shapes.
Variable sigmoid_gated(const Variable& x, const Variable& gate);
// q, k (B, T, Hk * dk), v (B, T, Hv * dv), g and beta (B, T, Hv) -> (B, T, Hv * dv): the gated
// delta rule from a zero state (kernels/deltanet/gated_delta.h; value head h reads key head
// h % Hk), q scaled by `scale`, in chunks of `chunk`. Its backward keeps each chunk's initial
// state, (B, Hv, T / chunk + 1, dk, dv), as activations. Decoding, without gradients: from
// `state` (B, Hv, dk, dv), which receives the state after x, in the recurrent form. Packed
// rows: `positions` as causal_conv_silu's, each sequence from a zero state.
Variable gated_delta_rule(const Variable& q, const Variable& k, const Variable& v,
                          const Variable& g, const Variable& beta, int64_t key_heads,
                          int64_t value_heads, float scale, Tensor* state = nullptr,
                          int64_t chunk = 64, const Tensor& positions = Tensor());
// x, z (..., H * D), w (D) -> each head of x RMS-normalised and scaled by w, times silu(z).
Variable gated_head_rmsnorm(const Variable& x, const Variable& z, const Variable& w, int64_t heads,
                            float eps);

}  // namespace cputrain
