#include "engine/adamw.h"

#include <cmath>

#include "kernels/adamw.h"
#include "kernels/vector_add.h"

namespace cputrain {

AdamW::AdamW(const ParameterSet& params, const AdamWConfig& config)
    : params_(params),
      config_(config),
      m_(Tensor::zeros(Shape{params.trainable_numel()}, DType::F32,
                       MemoryCategory::OptimizerState)),
      v_(Tensor::zeros(Shape{params.trainable_numel()}, DType::F32,
                       MemoryCategory::OptimizerState)) {}

double gradient_norm(const ParameterSet& params) {
  if (params.gradients().defined() && params.gradients().measured()) return 0.0;
  double sum = 0.0;
  for (const ParameterInfo& p : params.infos())
    if (p.trainable)
      sum += kernels::vector_sum_squares(params.gradients().f32() + p.grad_offset, p.shape.numel());
  return std::sqrt(sum);
}

float AdamW::step(float lr) {
  return step(lr, gradient_norm(params_));
}

float AdamW::step(float lr, double norm) {
  ++step_;
  // torch: clip_coef = max_norm / (norm + 1e-6), clamped to at most 1.
  float scale = 1.0f;
  if (config_.grad_clip > 0.0f) {
    const float coef = config_.grad_clip / (static_cast<float>(norm) + 1e-6f);
    scale = coef < 1.0f ? coef : 1.0f;
  }
  if (m_.measured()) return static_cast<float>(norm);
  for (const ParameterInfo& p : params_.infos()) {
    if (!p.trainable) continue;
    kernels::AdamWHyper h;
    h.lr = lr;
    h.beta1 = config_.beta1;
    h.beta2 = config_.beta2;
    h.eps = config_.eps;
    h.weight_decay = p.decay ? config_.weight_decay : 0.0f;
    h.step = step_;
    kernels::adamw_update(params_.weights().f32() + p.offset,
                          params_.gradients().f32() + p.grad_offset, m_.f32() + p.grad_offset,
                          v_.f32() + p.grad_offset, p.shape.numel(), h, scale,
                          params_.has_bf16_copies() && p.bf16_offset >= 0
                              ? params_.bf16_weights().bf16() + p.bf16_offset
                              : nullptr);
  }
  return static_cast<float>(norm);
}

}  // namespace cputrain
