// The trainable parameters of a model: one contiguous FP32 allocation for the weights and one
// for their gradients (llm.c's layout), described by a table of names, shapes and offsets.
// Each parameter is a Variable viewing its slice, with its gradient bound to the matching
// slice of the gradient buffer.
#pragma once

#include <string>
#include <vector>

#include "engine/autograd.h"

namespace cputrain {

struct ParameterInfo {
  std::string name;
  Shape shape;
  int64_t offset = 0;  // in elements, into weights() and gradients()
  bool decay = false;  // takes weight decay (matrices do, norm gains do not)
  bool bf16_copy = false;     // gets a bf16 copy in bf16 training (it feeds GEMMs)
  int64_t bf16_offset = -1;   // in elements, into bf16_weights(), once the copies exist
};

class ParameterSet {
 public:
  // Declares a parameter; returns its index. Only before allocate().
  int add(const std::string& name, const Shape& shape, bool decay, bool bf16_copy = false);
  // Allocates the weights (zeroed) and gradients (zeroed) for everything declared.
  void allocate();

  const std::vector<ParameterInfo>& infos() const { return infos_; }
  const Variable& var(int index) const { return vars_[index]; }
  int64_t numel() const { return numel_; }
  const Tensor& weights() const { return weights_; }
  const Tensor& gradients() const { return gradients_; }
  // Index of the parameter called `name`, or -1.
  int find(const std::string& name) const;
  void zero_grad() const { gradients_.fill_zero(); }

  // Allocates (once) the bf16 copies of the parameters declared with bf16_copy, as
  // Bf16Weights, attaches each to its Variable (Variable::bf16_value) and fills them. AdamW
  // writes them in its update; whoever writes the weights otherwise calls sync_bf16_copies().
  void enable_bf16_copies();
  // Elements the bf16 copies take, padding included (known once the parameters are declared).
  int64_t bf16_copy_numel() const;
  bool has_bf16_copies() const { return bf16_weights_.defined(); }
  const Tensor& bf16_weights() const { return bf16_weights_; }
  // Rounds the current weights into the copies; nothing without them.
  void sync_bf16_copies() const;

 private:
  std::vector<ParameterInfo> infos_;
  std::vector<Variable> vars_;
  int64_t numel_ = 0;
  Tensor weights_;
  Tensor gradients_;
  Tensor bf16_weights_;
};

}  // namespace cputrain
