// The row kernels around Gated DeltaNet's delta rule (models/ and engine/core/deltanet_ops.h): the
// L2 normalisation of q and k, the gated RMSNorm of its output, its decay and write strength, and
// the sigmoid gate of Qwen3.5's full attention. Rows of D elements, N rows, FP32.
#pragma once

#include <cstdint>

namespace cputrain::kernels {

// y = x / sqrt(sum(x^2) + eps) per row; rnorm (N) receives each 1 / sqrt(sum + eps).
void l2norm_forward(float* y, float* rnorm, const float* x, int64_t N, int64_t D, float eps);
// dx = (dy - y (dy . y)) rnorm, overwritten or added (accumulate).
void l2norm_backward(float* dx, const float* dy, const float* y, const float* rnorm, int64_t N,
                     int64_t D, bool accumulate);

// y = x / sqrt(mean(x^2) + eps) * w * silu(z) per row, w (D); rstd (N) receives each row's
// 1 / sqrt(mean + eps).
void gated_rmsnorm_forward(float* y, float* rstd, const float* x, const float* z, const float* w,
                           int64_t N, int64_t D, float eps);
// dx, dz overwritten or added (accumulate); dw (D) added to. Both vectorised by runtime dispatch
// (deltanet_rows.h); the _reference forms are one element at a time, for the tests.
void gated_rmsnorm_backward(float* dx, float* dz, float* dw, const float* dy, const float* x,
                            const float* z, const float* w, const float* rstd, int64_t N, int64_t D,
                            bool accumulate);
void gated_rmsnorm_forward_reference(float* y, float* rstd, const float* x, const float* z,
                                     const float* w, int64_t N, int64_t D, float eps);
void gated_rmsnorm_backward_reference(float* dx, float* dz, float* dw, const float* dy,
                                      const float* x, const float* z, const float* w,
                                      const float* rstd, int64_t N, int64_t D, bool accumulate);

// g = -exp(a_log[h]) * softplus(a + dt_bias[h]) for a (N, H).
void deltanet_decay_forward(float* g, const float* a, const float* a_log, const float* dt_bias,
                            int64_t N, int64_t H);
// da overwritten or added (accumulate); da_log, ddt_bias (H) added to.
void deltanet_decay_backward(float* da, float* da_log, float* ddt_bias, const float* dg,
                             const float* a, const float* a_log, const float* dt_bias, int64_t N,
                             int64_t H, bool accumulate);

// y = x * sigmoid(gate) (gate nullptr: y = sigmoid(x)), n elements.
void sigmoid_gate_forward(float* y, const float* x, const float* gate, int64_t n);
// dx, dgate overwritten or added (accumulate; either may be nullptr: not wanted). Without a
// gate, dx is sigmoid's gradient.
void sigmoid_gate_backward(float* dx, float* dgate, const float* dy, const float* x,
                           const float* gate, int64_t n, bool accumulate);

}  // namespace cputrain::kernels
