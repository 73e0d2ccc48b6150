// The bias of a linear layer: added to every row of its output, and its gradient, the sum of
// the output gradient's rows.
#pragma once

#include <cstdint>

namespace cputrain::kernels {

// y (M, N) += b (N) on every row.
void bias_add(float* y, const float* b, int64_t M, int64_t N);
// y (M, N) = bf16(x + b) on every row: the rounding of what bias_add gives.
void bias_add_rounded(uint16_t* y, const float* x, const float* b, int64_t M, int64_t N);
// db (N) += (accumulate) or = the column sums of dy (M, N), FP32 or bf16, summed over rows in
// order (so the result does not depend on the thread count).
void bias_backward(float* db, const float* dy, int64_t M, int64_t N, bool accumulate);
void bias_backward(float* db, const uint16_t* dy, int64_t M, int64_t N, bool accumulate);

}  // namespace cputrain::kernels
