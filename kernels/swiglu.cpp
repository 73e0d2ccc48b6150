#include "kernels/swiglu.h"

#include <cmath>

namespace cputrain::kernels {

void swiglu_forward(float* out, const float* gate, const float* up, int64_t n) {
#pragma omp parallel for schedule(static) if (n > 16384)
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate,
                     const float* up, int64_t n) {
#pragma omp parallel for schedule(static) if (n > 16384)
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    const float sig = 1.0f / (1.0f + std::exp(-g));
    const float silu = g * sig;
    // d silu / dg = sig * (1 + g * (1 - sig))
    dgate[i] += dout[i] * up[i] * sig * (1.0f + g * (1.0f - sig));
    dup[i] += dout[i] * silu;
  }
}

}  // namespace cputrain::kernels
