// Token embedding lookup.
#pragma once

#include <cstdint>

namespace cputrain::kernels {

// tokens (N), every id in [0, V); table (V, C); out (N, C).
void embedding_forward(float* out, const int32_t* tokens, const float* table, int64_t N, int64_t C);
// The same from a bf16 table, widened.
void embedding_forward_bf16(float* out, const int32_t* tokens, const uint16_t* table, int64_t N,
                            int64_t C);
// dtable (V, C) += scatter of dout (N, C) by token id.
void embedding_backward(float* dtable, const float* dout, const int32_t* tokens, int64_t N,
                        int64_t C);

}  // namespace cputrain::kernels
