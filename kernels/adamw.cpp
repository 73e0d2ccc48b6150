#include "kernels/adamw.h"

#include <cmath>

#include "kernels/bf16.h"

namespace cputrain::kernels {

void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n,
                  const AdamWHyper& h, float grad_scale, uint16_t* bf16_copy) {
  const double step = static_cast<double>(h.step);
  const float bias1 = static_cast<float>(1.0 - std::pow(static_cast<double>(h.beta1), step));
  const float bias2 = static_cast<float>(1.0 - std::pow(static_cast<double>(h.beta2), step));
  const float step_size = h.lr / bias1;
  const float bias2_sqrt = std::sqrt(bias2);
  const float decay = 1.0f - h.lr * h.weight_decay;
  const float b1 = h.beta1, b2 = h.beta2, eps = h.eps;
#pragma omp parallel for schedule(static) if (n > 16384)
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i] * grad_scale;
    const float mi = b1 * m[i] + (1.0f - b1) * g;
    const float vi = b2 * v[i] + (1.0f - b2) * g * g;
    m[i] = mi;
    v[i] = vi;
    const float p = param[i] * decay - step_size * mi / (std::sqrt(vi) / bias2_sqrt + eps);
    param[i] = p;
    if (bf16_copy != nullptr) bf16_copy[i] = fp32_to_bf16(p);
  }
}

}  // namespace cputrain::kernels
