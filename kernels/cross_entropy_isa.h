// The cross-entropy implementations behind the dispatch in cross_entropy.cpp, one per ISA, each
// with the contract of its function in cross_entropy.h. The AVX-512 ones may only be called where
// cpu_features().avx512 is set.
#pragma once

#include <cstdint>

namespace cputrain::kernels {

void cross_entropy_forward_avx2(float* losses, float* lse, const float* logits,
                                const int32_t* targets, int64_t N, int64_t V);
void cross_entropy_backward_avx2(float* dlogits, const float* logits, const float* lse,
                                 const int32_t* targets, const float* dlosses, int64_t N,
                                 int64_t V);
void cross_entropy_gradient_avx2(float* out, const float* logits, const float* lse,
                                 const int32_t* targets, float scale, int64_t N, int64_t V);
void cross_entropy_forward_avx512(float* losses, float* lse, const float* logits,
                                  const int32_t* targets, int64_t N, int64_t V);
void cross_entropy_backward_avx512(float* dlogits, const float* logits, const float* lse,
                                   const int32_t* targets, const float* dlosses, int64_t N,
                                   int64_t V);
void cross_entropy_gradient_avx512(float* out, const float* logits, const float* lse,
                                   const int32_t* targets, float scale, int64_t N, int64_t V);

}  // namespace cputrain::kernels
