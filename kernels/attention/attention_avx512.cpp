// The tiled attention compiled for AVX-512: one zmm per vector, register blocks of 6 rows.
#include "kernels/attention/attention_isa.h"
#include "kernels/attention/attention_tiled.h"

namespace cputrain::kernels {

void attention_forward_avx512(float* out, float* lse, const float* q, const float* k,
                              const float* v, int64_t B, int64_t T, int64_t H, int64_t KVH,
                              int64_t D, const AttentionOptions& options) {
  detail::attention_forward_tiled<6>(out, lse, q, k, v, B, T, H, KVH, D, options);
}

void attention_backward_avx512(float* dq, float* dk, float* dv, const float* dout, const float* q,
                               const float* k, const float* v, const float* out, const float* lse,
                               int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D,
                               bool accumulate, const AttentionOptions& options) {
  detail::attention_backward_tiled<6>(dq, dk, dv, dout, q, k, v, out, lse, B, T, H, KVH, D,
                                      accumulate, options);
}

const AttentionKernels& attention_kernels_avx512() {
  static const AttentionKernels k{attention_forward_avx512, attention_backward_avx512, nullptr,
                                  nullptr};
  return k;
}

}  // namespace cputrain::kernels
