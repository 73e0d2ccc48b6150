#include "engine/parameters.h"

#include <stdexcept>

namespace cputrain {

int ParameterSet::add(const std::string& name, const Shape& shape, bool decay) {
  if (weights_.defined()) throw std::logic_error("ParameterSet::add after allocate");
  infos_.push_back({name, shape, numel_, decay});
  // Each parameter starts on a 64-byte boundary.
  numel_ += (shape.numel() + 15) / 16 * 16;
  return static_cast<int>(infos_.size()) - 1;
}

void ParameterSet::allocate() {
  weights_ = Tensor::zeros(Shape{numel_}, DType::F32, MemoryCategory::Weights);
  gradients_ = Tensor::zeros(Shape{numel_}, DType::F32, MemoryCategory::Gradients);
  vars_.clear();
  for (const ParameterInfo& p : infos_) {
    Variable v(weights_.view(p.offset, p.shape), true);
    v.grad_ref()->bind(gradients_.view(p.offset, p.shape));
    vars_.push_back(v);
  }
}

int ParameterSet::find(const std::string& name) const {
  for (size_t i = 0; i < infos_.size(); ++i)
    if (infos_[i].name == name) return static_cast<int>(i);
  return -1;
}

}  // namespace cputrain
