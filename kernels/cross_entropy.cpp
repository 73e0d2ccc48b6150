#include "kernels/cross_entropy.h"

#include "kernels/cpu_features.h"
#include "kernels/cross_entropy_isa.h"

namespace cputrain::kernels {

void cross_entropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets,
                           int64_t N, int64_t V) {
  if (cpu_features().avx512)
    return cross_entropy_forward_avx512(losses, lse, logits, targets, N, V);
  cross_entropy_forward_avx2(losses, lse, logits, targets, N, V);
}

void cross_entropy_backward(float* dlogits, const float* logits, const float* lse,
                            const int32_t* targets, const float* dlosses, int64_t N, int64_t V) {
  if (cpu_features().avx512)
    return cross_entropy_backward_avx512(dlogits, logits, lse, targets, dlosses, N, V);
  cross_entropy_backward_avx2(dlogits, logits, lse, targets, dlosses, N, V);
}

void cross_entropy_gradient(float* out, const float* logits, const float* lse,
                            const int32_t* targets, float scale, int64_t N, int64_t V) {
  if (cpu_features().avx512)
    return cross_entropy_gradient_avx512(out, logits, lse, targets, scale, N, V);
  cross_entropy_gradient_avx2(out, logits, lse, targets, scale, N, V);
}

}  // namespace cputrain::kernels
