// The attention implementations behind the dispatch in attention.cpp, one per ISA, each with
// the contract of attention_forward / attention_backward in attention.h. The AVX-512 ones may
// only be called where cpu_features().avx512 is set.
#pragma once

#include <cstdint>

namespace cputrain::kernels {

void attention_forward_avx2(float* out, float* lse, const float* q, const float* k,
                            const float* v, int64_t B, int64_t T, int64_t H, int64_t D);
void attention_backward_avx2(float* dq, float* dk, float* dv, const float* dout, const float* q,
                             const float* k, const float* v, const float* out, const float* lse,
                             int64_t B, int64_t T, int64_t H, int64_t D);
void attention_forward_avx512(float* out, float* lse, const float* q, const float* k,
                              const float* v, int64_t B, int64_t T, int64_t H, int64_t D);
void attention_backward_avx512(float* dq, float* dk, float* dv, const float* dout, const float* q,
                               const float* k, const float* v, const float* out, const float* lse,
                               int64_t B, int64_t T, int64_t H, int64_t D);

}  // namespace cputrain::kernels
