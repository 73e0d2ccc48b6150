// Gated DeltaNet's elementwise implementations behind the dispatch in causal_conv.cpp and
// deltanet_ops.cpp, one table per ISA, each entry with the contract of its function there
// (causal_conv_silu_forward_f32, causal_conv_silu_backward_f32, gated_rmsnorm_forward,
// gated_rmsnorm_backward). The AVX-512 table may only be used where cpu_features().avx512 is set.
#pragma once

#include <cstdint>
#include <string_view>

#include "kernels/deltanet/causal_conv.h"

namespace cputrain::kernels {

struct DeltanetKernels {
  void (*conv_forward)(const CausalConvShape& s, const float* x, const float* w, float* y);
  void (*conv_backward)(const CausalConvShape& s, const float* x, const float* w, const float* dy,
                        float* dx, float* dw);
  void (*gated_rmsnorm_forward)(float* y, float* rstd, const float* x, const float* z,
                                const float* w, int64_t N, int64_t D, float eps);
  void (*gated_rmsnorm_backward)(float* dx, float* dz, float* dw, const float* dy, const float* x,
                                 const float* z, const float* w, const float* rstd, int64_t N,
                                 int64_t D, bool accumulate);
};

const DeltanetKernels& deltanet_kernels_avx2();
const DeltanetKernels& deltanet_kernels_avx512();
// The table runtime dispatch picks for this machine, and its name ("avx512").
const DeltanetKernels& deltanet_kernels();
std::string_view deltanet_kernel();

}  // namespace cputrain::kernels
