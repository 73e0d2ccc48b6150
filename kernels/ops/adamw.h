// AdamW (Loshchilov & Hutter 2019) on FP32 master weights, one fused pass per tensor.
#pragma once

#include <cstdint>

namespace cputrain::kernels {

struct AdamWHyper {
  float lr = 3e-4f;
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;  // decoupled: applied as param *= 1 - lr * weight_decay
  int64_t step = 1;           // 1-based step count, for bias correction
};

// With g = grad * grad_scale (grad_scale carries gradient clipping), the same arithmetic as
// torch.optim.AdamW:
//   param *= 1 - lr * wd
//   m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
//   param -= (lr / (1 - beta1^step)) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
// When bf16_copy is not null it receives the updated param rounded to bf16 in the same pass.
void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n,
                  const AdamWHyper& hyper, float grad_scale, uint16_t* bf16_copy);

}  // namespace cputrain::kernels
