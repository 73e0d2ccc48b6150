// The cross-entropy implementations behind the dispatch in cross_entropy.cpp, one table per ISA,
// each entry with the contract of its function in cross_entropy.h. The AVX-512 table may only be
// used where cpu_features().avx512 is set.
#pragma once

#include <cstdint>

namespace cputrain::kernels {

struct CrossEntropyKernels {
  void (*forward)(float* losses, float* lse, const float* logits, const int32_t* targets, int64_t N,
                  int64_t V);
  void (*backward)(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                   const float* dlosses, int64_t N, int64_t V);
  void (*gradient)(float* out, const float* logits, const float* lse, const int32_t* targets,
                   float scale, int64_t N, int64_t V);
  void (*forward_gradient)(float* out, uint16_t* out_bf16, float* losses, const float* logits,
                           float* work, const int32_t* targets, float scale, int64_t N, int64_t V);
  void (*soft_cap)(float* x, int64_t n, float cap);
  void (*soft_cap_gradient)(float* g, const float* capped, int64_t n, float cap);
};

const CrossEntropyKernels& cross_entropy_kernels_avx2();
const CrossEntropyKernels& cross_entropy_kernels_avx512();

}  // namespace cputrain::kernels
