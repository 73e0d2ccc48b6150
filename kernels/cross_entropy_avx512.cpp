// The cross-entropy row loops compiled for AVX-512: one zmm per vector.
#include "kernels/cross_entropy_isa.h"
#include "kernels/cross_entropy_rows.h"

namespace cputrain::kernels {

void cross_entropy_forward_avx512(float* losses, float* lse, const float* logits,
                                  const int32_t* targets, int64_t N, int64_t V) {
  detail::ce_forward(losses, lse, logits, targets, N, V);
}

void cross_entropy_backward_avx512(float* dlogits, const float* logits, const float* lse,
                                   const int32_t* targets, const float* dlosses, int64_t N,
                                   int64_t V) {
  detail::ce_backward(dlogits, logits, lse, targets, dlosses, N, V);
}

void cross_entropy_gradient_avx512(float* out, const float* logits, const float* lse,
                                   const int32_t* targets, float scale, int64_t N, int64_t V) {
  detail::ce_gradient(out, logits, lse, targets, scale, N, V);
}

}  // namespace cputrain::kernels
