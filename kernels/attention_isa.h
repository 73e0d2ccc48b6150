// The attention implementations behind the dispatch in attention.cpp, one per ISA, each with
// the contract of attention_forward / attention_backward in attention.h. The AVX-512 ones may
// only be called where cpu_features().avx512 is set, the bf16 ones where avx512_bf16 is.
#pragma once

#include <cstdint>

namespace cputrain::kernels {

void attention_forward_avx2(float* out, float* lse, const float* q, const float* k,
                            const float* v, int64_t B, int64_t T, int64_t H, int64_t D);
void attention_backward_avx2(float* dq, float* dk, float* dv, const float* dout, const float* q,
                             const float* k, const float* v, const float* out, const float* lse,
                             int64_t B, int64_t T, int64_t H, int64_t D, bool accumulate);
void attention_forward_avx512(float* out, float* lse, const float* q, const float* k,
                              const float* v, int64_t B, int64_t T, int64_t H, int64_t D);
void attention_backward_avx512(float* dq, float* dk, float* dv, const float* dout, const float* q,
                               const float* k, const float* v, const float* out, const float* lse,
                               int64_t B, int64_t T, int64_t H, int64_t D, bool accumulate);
void attention_forward_bf16_avx512(uint16_t* out, float* lse, const uint16_t* q, const uint16_t* k,
                                   const uint16_t* v, int64_t B, int64_t T, int64_t H,
                                   int64_t D);
void attention_backward_bf16_avx512(float* dq, float* dk, float* dv, const float* dout,
                                    const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                    const uint16_t* out, const float* lse, int64_t B, int64_t T,
                                    int64_t H, int64_t D, bool accumulate);

}  // namespace cputrain::kernels
