// The gated-activation implementations behind the dispatch in swiglu.cpp, one table per ISA and
// activation, each entry with the contract of its function in swiglu.h. The AVX-512 tables may
// only be used where cpu_features().avx512 is set.
#pragma once

#include <cstdint>

#include "kernels/ops/swiglu.h"

namespace cputrain::kernels {

struct SwigluKernels {
  void (*forward)(float* out, const float* gate, const float* up, int64_t n);
  void (*forward_bf16)(uint16_t* out, uint16_t* gate16, uint16_t* up16, const float* gate,
                       const float* up, int64_t n);
  void (*backward)(float* dgate, float* dup, const float* dout, const float* gate, const float* up,
                   int64_t n, bool accumulate);
  void (*backward_bf16)(float* dgate, float* dup, const float* dout, const uint16_t* gate,
                        const uint16_t* up, int64_t n, bool accumulate);
  void (*backward_rounded)(uint16_t* dgate, uint16_t* dup, const float* dout, const uint16_t* gate,
                           const uint16_t* up, int64_t n);
};

const SwigluKernels& swiglu_kernels_avx2(Activation act = Activation::Silu);
const SwigluKernels& swiglu_kernels_avx512(Activation act = Activation::Silu);

}  // namespace cputrain::kernels
