// Token embedding lookup.
#pragma once

#include <cstdint>

namespace cputrain::kernels {

// tokens (N), every id in [0, V); table (V, C); out (N, C): each token's row times scale (Gemma
// scales its embeddings by sqrt(C); 1 copies the rows).
void embedding_forward(float* out, const int32_t* tokens, const float* table, int64_t N, int64_t C,
                       float scale = 1.0f);
// The same from a bf16 table, widened.
void embedding_forward_bf16(float* out, const int32_t* tokens, const uint16_t* table, int64_t N,
                            int64_t C, float scale = 1.0f);
// dtable (V, C) += scatter of scale * dout (N, C) by token id.
void embedding_backward(float* dtable, const float* dout, const int32_t* tokens, int64_t N,
                        int64_t C, float scale = 1.0f);

}  // namespace cputrain::kernels
