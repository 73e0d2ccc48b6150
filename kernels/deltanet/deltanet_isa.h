// Gated DeltaNet's implementations behind the dispatch in causal_conv.cpp, deltanet_ops.cpp and
// gated_delta.cpp, one table per ISA, each elementwise entry with the contract of its function
// there (causal_conv_silu_forward_f32, causal_conv_silu_backward_f32, gated_rmsnorm_forward,
// gated_rmsnorm_backward), and the delta rule's chunk products on bf16 where the ISA has them.
// A table may only be used where its level is usable (kernels/cpu/dispatch.h): avx512 where
// cpu_features().avx512 is set, avx512_bf16 where avx512_bf16 is, amx where amx_bf16 is.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "kernels/deltanet/causal_conv.h"

namespace cputrain::kernels {

// The calling thread's scratch for product_bf16: the operands as bf16 pairs and the FP32
// product, grown to the largest product it meets.
struct PairsScratch {
  std::vector<uint32_t> a, b, row;
  std::vector<float> c;
};

struct DeltanetKernels {
  void (*conv_forward)(const CausalConvShape& s, const float* x, const float* w, float* y);
  void (*conv_backward)(const CausalConvShape& s, const float* x, const float* w, const float* dy,
                        float* dx, float* dw);
  void (*gated_rmsnorm_forward)(float* y, float* rstd, const float* x, const float* z,
                                const float* w, int64_t N, int64_t D, float eps);
  void (*gated_rmsnorm_backward)(float* dx, float* dz, float* dw, const float* dy, const float* x,
                                 const float* z, const float* w, const float* rstd, int64_t N,
                                 int64_t D, bool accumulate);
  // C (M x N) = op(A) op(B) + beta C as gemm_f32 (kernels/gemm/gemm.h; beta 0 or 1), with the
  // elements of A and B rounded to bf16 (fp32_to_bf16) and their products summed in FP32, on
  // vdpbf16ps or AMX tiles; for the small products of one thread (a chunk of the delta rule, at
  // most a few hundred rows and columns), packed into `scratch`. nullptr where the ISA has no
  // bf16 products.
  void (*product_bf16)(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const float* A,
                       int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc,
                       PairsScratch& scratch);
};

const DeltanetKernels& deltanet_kernels_avx2();
const DeltanetKernels& deltanet_kernels_avx512();
const DeltanetKernels& deltanet_kernels_avx512_bf16();  // deltanet_bf16_avx512.cpp
const DeltanetKernels& deltanet_kernels_amx();          // deltanet_bf16_avx512.cpp
// The table runtime dispatch picks for this machine, and its name ("avx512").
const DeltanetKernels& deltanet_kernels();
std::string_view deltanet_kernel();

}  // namespace cputrain::kernels
