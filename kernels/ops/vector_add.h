// Elementwise sums used by residual connections and gradient accumulation.
#pragma once

#include <cstdint>

namespace cputrain::kernels {

// out = a + b (out may alias a or b).
void vector_add(float* out, const float* a, const float* b, int64_t n);
// dst += src.
void vector_accumulate(float* dst, const float* src, int64_t n);
// dst = s * src.
void vector_scale(float* dst, const float* src, float s, int64_t n);
// dst = src.
void vector_copy(float* dst, const float* src, int64_t n);
// sum of x^2, accumulated in double (for global gradient norms).
double vector_sum_squares(const float* x, int64_t n);

}  // namespace cputrain::kernels
