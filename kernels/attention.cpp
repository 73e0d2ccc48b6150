#include "kernels/attention.h"

#include "kernels/attention_isa.h"
#include "kernels/cpu_features.h"

namespace cputrain::kernels {

void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                       int64_t B, int64_t T, int64_t H, int64_t D) {
  if (cpu_features().avx512) return attention_forward_avx512(out, lse, q, k, v, B, T, H, D);
  attention_forward_avx2(out, lse, q, k, v, B, T, H, D);
}

void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                        const float* k, const float* v, const float* out, const float* lse,
                        int64_t B, int64_t T, int64_t H, int64_t D) {
  if (cpu_features().avx512)
    return attention_backward_avx512(dq, dk, dv, dout, q, k, v, out, lse, B, T, H, D);
  attention_backward_avx2(dq, dk, dv, dout, q, k, v, out, lse, B, T, H, D);
}

}  // namespace cputrain::kernels
