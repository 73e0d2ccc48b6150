#include "kernels/ops/cross_entropy.h"

#include "kernels/cpu/dispatch.h"
#include "kernels/ops/cross_entropy_isa.h"

namespace cputrain::kernels {
namespace {

// The implementations, fastest first (kernels/cpu/dispatch.h).
using CrossEntropyRow = KernelChoice<const CrossEntropyKernels& (*)()>;
const CrossEntropyRow kCrossEntropy[] = {
    {{"avx512", Isa::Avx512}, cross_entropy_kernels_avx512},
    {{"avx2", Isa::Avx2}, cross_entropy_kernels_avx2},
};

const CrossEntropyRow& chosen() {
  static const CrossEntropyRow& row = choose_kernel("cross_entropy", kCrossEntropy);
  return row;
}

const CrossEntropyKernels& kernels() {
  static const CrossEntropyKernels& k = chosen().entry();
  return k;
}

}  // namespace

std::string_view cross_entropy_kernel() {
  return chosen().row.name;
}

void cross_entropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets,
                           int64_t N, int64_t V) {
  kernels().forward(losses, lse, logits, targets, N, V);
}

void cross_entropy_backward(float* dlogits, const float* logits, const float* lse,
                            const int32_t* targets, const float* dlosses, int64_t N, int64_t V) {
  kernels().backward(dlogits, logits, lse, targets, dlosses, N, V);
}

void cross_entropy_gradient(float* out, const float* logits, const float* lse,
                            const int32_t* targets, float scale, int64_t N, int64_t V) {
  kernels().gradient(out, logits, lse, targets, scale, N, V);
}

void cross_entropy_forward_gradient(float* out, float* losses, const float* logits,
                                    const int32_t* targets, float scale, int64_t N, int64_t V) {
  kernels().forward_gradient(out, nullptr, losses, logits, out, targets, scale, N, V);
}

void cross_entropy_forward_gradient_bf16(uint16_t* out_bf16, float* losses, float* logits,
                                         const int32_t* targets, float scale, int64_t N,
                                         int64_t V) {
  kernels().forward_gradient(nullptr, out_bf16, losses, logits, logits, targets, scale, N, V);
}

void logit_soft_cap(float* x, int64_t n, float cap) {
  kernels().soft_cap(x, n, cap);
}

void logit_soft_cap_gradient(float* g, const float* capped, int64_t n, float cap) {
  kernels().soft_cap_gradient(g, capped, n, cap);
}

}  // namespace cputrain::kernels
