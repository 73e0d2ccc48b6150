// AdamW over the trainable parameters of a ParameterSet, with global gradient-norm clipping (as
// torch.nn.utils.clip_grad_norm_ followed by torch.optim.AdamW). m and v are laid out as the
// gradients are (ParameterInfo::grad_offset).
#pragma once

#include "engine/parameters.h"

namespace cputrain {

struct AdamWConfig {
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.1f;  // on parameters with decay set (matrices)
  float grad_clip = 1.0f;     // max global L2 norm; 0 disables clipping
};

class AdamW {
 public:
  AdamW(const ParameterSet& params, const AdamWConfig& config);
  // One update at learning rate lr from the accumulated gradients; returns the global
  // gradient norm before clipping. Gradients are left as they are.
  float step(float lr);
  // The same with the global gradient norm already computed (gradient_norm).
  float step(float lr, double norm);
  int64_t step_count() const { return step_; }
  const Tensor& m() const { return m_; }
  const Tensor& v() const { return v_; }
  // For restoring a saved state.
  void set_step_count(int64_t step) { step_ = step; }

 private:
  const ParameterSet& params_;
  AdamWConfig config_;
  Tensor m_;
  Tensor v_;
  int64_t step_ = 0;
};

// Global L2 norm of the gradients of the set's trainable parameters.
double gradient_norm(const ParameterSet& params);

}  // namespace cputrain
