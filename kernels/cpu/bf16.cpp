#include "kernels/cpu/bf16.h"

namespace cputrain::kernels {

void fp32_to_bf16_array(uint16_t* out, const float* in, int64_t n) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) out[i] = fp32_to_bf16(in[i]);
}

void bf16_to_fp32_array(float* out, const uint16_t* in, int64_t n) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_fp32(in[i]);
}

}  // namespace cputrain::kernels
