#include "kernels/ops/adamw.h"

#include <algorithm>
#include <cmath>

#include "kernels/cpu/bf16.h"
#include "kernels/cpu/vec16.h"

namespace cputrain::kernels {
namespace {

struct Constants {
  float grad_scale, b1, b2, eps, step_size, bias2_sqrt, decay;
};
struct Lanes {
  vec::vf p, m, v;
};

inline __attribute__((always_inline)) Lanes update(const Constants& c, vec::vf param, vec::vf grad,
                                                   vec::vf m, vec::vf v) {
  const vec::vf g = grad * c.grad_scale;
  Lanes out;
  out.m = c.b1 * m + (1.0f - c.b1) * g;
  out.v = c.b2 * v + (1.0f - c.b2) * g * g;
  out.p = param * c.decay - c.step_size * out.m / (vec::sqrt(out.v) / c.bias2_sqrt + c.eps);
  return out;
}

}  // namespace

void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n,
                  const AdamWHyper& h, float grad_scale, uint16_t* bf16_copy) {
  const double step = static_cast<double>(h.step);
  const float bias1 = static_cast<float>(1.0 - std::pow(static_cast<double>(h.beta1), step));
  const float bias2 = static_cast<float>(1.0 - std::pow(static_cast<double>(h.beta2), step));
  const float step_size = h.lr / bias1;
  const float bias2_sqrt = std::sqrt(bias2);
  const float decay = 1.0f - h.lr * h.weight_decay;
  const float b1 = h.beta1, b2 = h.beta2, eps = h.eps;
  // Runs of 16 lanes (vec16.h, two ymm in this baseline build), the last one partial: the same
  // arithmetic for every element. (Written as a plain loop, GCC kept sqrt, for errno, and the
  // two divisions scalar.) The pass is bound by memory: 30 bytes moved per parameter.
  const Constants c{grad_scale, b1, b2, eps, step_size, bias2_sqrt, decay};
  const int64_t runs = (n + vec::kLanes - 1) / vec::kLanes;
#pragma omp parallel for schedule(static) if (n > 16384)
  for (int64_t r = 0; r < runs; ++r) {
    const int64_t i = r * vec::kLanes;
    const int lanes = static_cast<int>(std::min<int64_t>(vec::kLanes, n - i));
    Lanes x;
    if (lanes == vec::kLanes) {
      x = update(c, vec::load(param + i), vec::load(grad + i), vec::load(m + i), vec::load(v + i));
      vec::store(param + i, x.p);
      vec::store(m + i, x.m);
      vec::store(v + i, x.v);
    } else {
      x = update(c, vec::load_partial(param + i, lanes, 0.0f),
                 vec::load_partial(grad + i, lanes, 0.0f), vec::load_partial(m + i, lanes, 0.0f),
                 vec::load_partial(v + i, lanes, 0.0f));
      vec::store_partial(param + i, x.p, lanes);
      vec::store_partial(m + i, x.m, lanes);
      vec::store_partial(v + i, x.v, lanes);
    }
    if (bf16_copy != nullptr) vec::store_bf16(bf16_copy + i, x.p, lanes);
  }
}

}  // namespace cputrain::kernels
