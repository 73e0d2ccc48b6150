#include "engine/parameters.h"

#include <stdexcept>

#include "kernels/bf16.h"

namespace cputrain {

int ParameterSet::add(const std::string& name, const Shape& shape, bool decay, bool bf16_copy) {
  if (weights_.defined()) throw std::logic_error("ParameterSet::add after allocate");
  infos_.push_back({name, shape, numel_, decay, bf16_copy});
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

namespace {
// bf16 elements of one copy: each starts on a 64-byte boundary, as the weights do.
int64_t padded_bf16(int64_t numel) { return (numel + 31) / 32 * 32; }
}  // namespace

int64_t ParameterSet::bf16_copy_numel() const {
  int64_t total = 0;
  for (const ParameterInfo& p : infos_)
    if (p.bf16_copy) total += padded_bf16(p.shape.numel());
  return total;
}

void ParameterSet::enable_bf16_copies() {
  if (!weights_.defined()) throw std::logic_error("ParameterSet::enable_bf16_copies before allocate");
  if (has_bf16_copies()) return;
  int64_t offset = 0;
  for (ParameterInfo& p : infos_) {
    if (!p.bf16_copy) continue;
    p.bf16_offset = offset;
    offset += padded_bf16(p.shape.numel());
  }
  bf16_weights_ = Tensor::zeros(Shape{offset}, DType::BF16, MemoryCategory::Bf16Weights);
  for (size_t i = 0; i < infos_.size(); ++i) {
    const ParameterInfo& p = infos_[i];
    if (p.bf16_offset >= 0) vars_[i].set_bf16_copy(bf16_weights_.view(p.bf16_offset, p.shape));
  }
  sync_bf16_copies();
}

void ParameterSet::sync_bf16_copies() const {
  if (!has_bf16_copies()) return;
  for (const ParameterInfo& p : infos_) {
    if (p.bf16_offset < 0) continue;
    kernels::fp32_to_bf16_array(bf16_weights_.bf16() + p.bf16_offset,
                                weights_.f32() + p.offset, p.shape.numel());
  }
}

int ParameterSet::find(const std::string& name) const {
  for (size_t i = 0; i < infos_.size(); ++i)
    if (infos_[i].name == name) return static_cast<int>(i);
  return -1;
}

}  // namespace cputrain
