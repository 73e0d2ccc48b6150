// Tape-based reverse-mode autograd. Each op computes its forward and records its backward, a
// closure holding exactly the tensors it needs, on the current tape. backward() runs the tape
// in reverse and releases each closure once it has run, so saved activations are freed as
// the backward pass reaches them.
#pragma once

#include <functional>
#include <memory>

#include "engine/core/tensor.h"

namespace cputrain {

// Where an op's backward accumulates the gradient of one variable. Kept apart from the value
// so a producer's backward can hold its output's gradient without keeping the output alive.
class GradCell {
 public:
  explicit GradCell(const Shape& shape) : shape_(shape) {}
  // The gradient, allocated zeroed (as workspace) on first use.
  const Tensor& get_or_zeros();
  // The gradient for a kernel that computes out = contribution + beta * out: allocated
  // uninitialised on first use with *beta = 0 (the first contribution overwrites it), else
  // *beta = 1.
  const Tensor& get_for_accumulate(float* beta);
  // The gradient if anything has been accumulated, else an undefined tensor. FP32, or BF16
  // where its single contribution was written as its rounding (rounded_for_overwrite).
  const Tensor& tensor() const { return grad_; }
  // Accumulate into an existing tensor (a parameter's slice of the flat gradient buffer).
  void bind(const Tensor& grad) { grad_ = grad; }

  // Contributions the backward pass will make: one per input slot of a recorded op that takes
  // this variable (needs_grad counts them).
  void add_contribution() { ++contributions_; }
  int contributions() const { return contributions_; }
  // Everything that reads this gradient takes only its bf16 rounding (the output of a linear
  // layer in bf16 mode).
  void set_read_rounded() { read_rounded_ = true; }
  // Whether the gradient is read only rounded, will receive exactly one contribution and has
  // none yet: that contribution may then write its rounding alone.
  bool rounded_ok() const { return read_rounded_ && contributions_ == 1 && !grad_.defined(); }
  // Where rounded_ok: a BF16 tensor (workspace) for the contribution to write its rounding into,
  // which becomes the gradient. Else an undefined tensor: write FP32 as usual.
  Tensor rounded_for_overwrite();

 private:
  Shape shape_;
  Tensor grad_;
  int contributions_ = 0;
  bool read_rounded_ = false;
};
using GradRef = std::shared_ptr<GradCell>;

class Variable {
 public:
  Variable() = default;
  // A leaf: a parameter or an input.
  Variable(const Tensor& value, bool requires_grad);
  // The output of an op (see ops.h). Its value is never written after creation, so its bf16
  // rounding is computed once and shared by every op that takes it.
  static Variable op_output(const Tensor& value, bool requires_grad);

  bool defined() const { return impl_ != nullptr; }
  const Tensor& value() const { return impl_->value; }
  const Shape& shape() const { return impl_->value.shape(); }
  // False for an undefined variable (an optional input an op was not given).
  bool requires_grad() const { return impl_ && impl_->grad != nullptr; }
  // Null when the variable does not require a gradient (or is undefined).
  const GradRef& grad_ref() const { return impl_ ? impl_->grad : no_grad_ref(); }
  const Tensor& grad() const;

  // The value rounded to bf16 (same shape, dtype BF16). A bf16 value is its own rounding (an
  // op that in bf16 mode writes only the rounding of its output). A leaf with a bf16 copy
  // attached (set_bf16_copy: the ParameterSet's, kept current by AdamW) returns that copy; an
  // op output converts once, as an activation, and keeps the result; any other leaf converts on
  // each call, into workspace, since its value may have been written since.
  Tensor bf16_value() const;
  void set_bf16_copy(const Tensor& copy);
  // An op output's bf16 rounding, made (or about to be made) by a pass that reads its value
  // anyway: what bf16_value will return, as a cache (an op output's value never changes).
  // Throws for a leaf.
  void cache_bf16_value(const Tensor& rounding) const;
  // Whether bf16_value needs no conversion: a rounding is attached or the value is bf16.
  bool has_bf16_value() const {
    return impl_->bf16.defined() || impl_->value.dtype() == DType::BF16;
  }
  bool is_op_output() const { return impl_->op_output; }

 private:
  struct Impl {
    Tensor value;
    GradRef grad;
    bool op_output = false;
    Tensor bf16;  // the attached copy or the cached rounding; undefined until there is one
  };
  static const GradRef& no_grad_ref() {
    static const GradRef none;
    return none;
  }
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

// The precision of the ops' arithmetic, F32 by default. Under BF16 (DESIGN.md, Numerics) the
// GEMMs take bf16 inputs and accumulate in FP32, and the activations ops save for backward are
// kept in bf16; norms, softmax, attention statistics and the loss stay in FP32. An op records
// the precision it ran under with its backward.
DType compute_dtype();
class ComputeDTypeGuard {
 public:
  explicit ComputeDTypeGuard(DType dtype);  // F32 or BF16
  ~ComputeDTypeGuard();
  ComputeDTypeGuard(const ComputeDTypeGuard&) = delete;
  ComputeDTypeGuard& operator=(const ComputeDTypeGuard&) = delete;

 private:
  DType previous_;
};

// True when an op over `inputs` must record a backward: grad is enabled and some input
// requires a gradient. Then every input that does is counted as one more contribution to its
// gradient (GradCell::contributions): each op calls it once, for the inputs its backward will
// write the gradients of.
bool needs_grad(std::initializer_list<const Variable*> inputs);

// Appends a backward closure to the current tape; the profiler times it under `op` (a string
// literal) as a backward pass.
void record_backward(const char* op, std::function<void()> backward);

// Seeds d(loss)/d(loss) = scale (loss has one element) and runs the current tape in reverse,
// emptying it. Gradients accumulate (+=) into bound parameter gradients.
void backward(const Variable& loss, float scale = 1.0f);
// The same from an arbitrary output with d(objective)/d(output) = grad_output (same shape).
void backward(const Variable& output, const Tensor& grad_output);

// Drops the current tape without running it (and so frees what it saved).
void clear_tape();
size_t tape_size();

// A checkpoint region, for per-layer gradient checkpointing. fn runs forward without recording,
// so nothing inside it is saved; the region keeps only its input x. When the backward pass
// reaches the region it runs fn again on x, under the precision of the forward pass and onto a
// tape of its own, and runs that tape: the same ops on the same values, so every gradient is
// bitwise what fn would give without the region. fn must be deterministic and must not depend
// on anything that changes between the forward and the backward pass. Without grad enabled it
// is fn(x).
Variable checkpoint(std::function<Variable(const Variable&)> fn, const Variable& x);
// The same for a region of several inputs, each kept.
Variable checkpoint(std::function<Variable(const std::vector<Variable>&)> fn,
                    const std::vector<Variable>& xs);

// Records onto a fresh tape for its scope; the enclosing tape is restored afterwards.
class TapeScope {
 public:
  TapeScope();
  ~TapeScope();
  TapeScope(const TapeScope&) = delete;
  TapeScope& operator=(const TapeScope&) = delete;
};

}  // namespace cputrain
