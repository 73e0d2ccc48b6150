// Tape-based reverse-mode autograd. Each op computes its forward and records its backward, a
// closure holding exactly the tensors it needs, on the current tape. backward() runs the tape
// in reverse and releases each closure once it has run, so saved activations are freed as
// the backward pass reaches them.
#pragma once

#include <functional>
#include <memory>

#include "engine/tensor.h"

namespace cputrain {

// Where an op's backward accumulates the gradient of one variable. Kept apart from the value
// so a producer's backward can hold its output's gradient without keeping the output alive.
class GradCell {
 public:
  explicit GradCell(const Shape& shape) : shape_(shape) {}
  // The gradient, allocated zeroed (as workspace) on first use.
  const Tensor& get_or_zeros();
  // The gradient if anything has been accumulated, else an undefined tensor.
  const Tensor& tensor() const { return grad_; }
  // Accumulate into an existing tensor (a parameter's slice of the flat gradient buffer).
  void bind(const Tensor& grad) { grad_ = grad; }

 private:
  Shape shape_;
  Tensor grad_;
};
using GradRef = std::shared_ptr<GradCell>;

class Variable {
 public:
  Variable() = default;
  Variable(const Tensor& value, bool requires_grad);

  bool defined() const { return impl_ != nullptr; }
  const Tensor& value() const { return impl_->value; }
  const Shape& shape() const { return impl_->value.shape(); }
  bool requires_grad() const { return impl_->grad != nullptr; }
  // Null when the variable does not require a gradient.
  const GradRef& grad_ref() const { return impl_->grad; }
  const Tensor& grad() const;

 private:
  struct Impl {
    Tensor value;
    GradRef grad;
  };
  std::shared_ptr<Impl> impl_;
};

// Gradient recording is on by default; NoGradGuard turns it off for its scope (sampling,
// evaluation, recomputation).
bool grad_enabled();
class NoGradGuard {
 public:
  NoGradGuard();
  ~NoGradGuard();
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool previous_;
};

// True when an op over `inputs` must record a backward: grad is enabled and some input
// requires a gradient.
bool needs_grad(std::initializer_list<const Variable*> inputs);

// Appends a backward closure to the current tape.
void record_backward(std::function<void()> backward);

// Seeds d(loss)/d(loss) = scale (loss has one element) and runs the current tape in reverse,
// emptying it. Gradients accumulate (+=) into bound parameter gradients.
void backward(const Variable& loss, float scale = 1.0f);
// The same from an arbitrary output with d(objective)/d(output) = grad_output (same shape).
void backward(const Variable& output, const Tensor& grad_output);

// Drops the current tape without running it (and so frees what it saved).
void clear_tape();
size_t tape_size();

// Records onto a fresh tape for its scope; the enclosing tape is restored afterwards.
class TapeScope {
 public:
  TapeScope();
  ~TapeScope();
  TapeScope(const TapeScope&) = delete;
  TapeScope& operator=(const TapeScope&) = delete;
};

}  // namespace cputrain
