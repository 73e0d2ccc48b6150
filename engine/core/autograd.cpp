#include "engine/core/autograd.h"

#include <deque>
#include <stdexcept>
#include <vector>

#include "engine/core/profiler.h"
#include "kernels/cpu/bf16.h"
#include "kernels/ops/vector_add.h"

namespace cputrain {
namespace {

bool g_grad_enabled = true;
DType g_compute_dtype = DType::F32;

struct TapeNode {
  const char* op;
  std::function<void()> backward;
};
using Tape = std::vector<TapeNode>;

// A deque: a tape being run stays where it is while a checkpoint region pushes another.
std::deque<Tape>& tapes() {
  static std::deque<Tape> stack(1);
  return stack;
}

Tape& current_tape() {
  return tapes().back();
}

void require_fp32(const Tensor& grad) {
  if (grad.defined() && grad.dtype() != DType::F32)
    throw std::logic_error(
        "a second contribution to a gradient its only one wrote rounded to bf16");
}

}  // namespace

Tensor GradCell::rounded_for_overwrite() {
  if (!rounded_ok()) return Tensor();
  grad_ = Tensor::empty(shape_, DType::BF16, MemoryCategory::Workspace);
  return grad_;
}

const Tensor& GradCell::get_for_accumulate(float* beta) {
  require_fp32(grad_);
  *beta = grad_.defined() ? 1.0f : 0.0f;
  if (!grad_.defined()) grad_ = Tensor::empty(shape_, DType::F32, MemoryCategory::Workspace);
  return grad_;
}

const Tensor& GradCell::get_or_zeros() {
  require_fp32(grad_);
  if (!grad_.defined()) grad_ = Tensor::zeros(shape_, DType::F32, MemoryCategory::Workspace);
  return grad_;
}

Variable::Variable(const Tensor& value, bool requires_grad)
    : impl_(std::make_shared<Impl>(
          Impl{value, requires_grad ? std::make_shared<GradCell>(value.shape()) : nullptr, false,
               Tensor()})) {}

Variable Variable::op_output(const Tensor& value, bool requires_grad) {
  Variable v(value, requires_grad);
  v.impl_->op_output = true;
  return v;
}

Tensor Variable::bf16_value() const {
  if (impl_->bf16.defined()) return impl_->bf16;
  const Tensor& v = impl_->value;
  if (v.dtype() == DType::BF16) return v;  // a value that is its own rounding
  Tensor b =
      Tensor::empty(v.shape(), DType::BF16,
                    impl_->op_output ? MemoryCategory::Activations : MemoryCategory::Workspace);
  profiler::Scope scope("to bf16", profiler::Pass::Enclosing);
  if (!measuring()) kernels::fp32_to_bf16_array(b.bf16(), v.f32(), v.numel());
  if (impl_->op_output) impl_->bf16 = b;
  return b;
}

void Variable::set_bf16_copy(const Tensor& copy) {
  if (copy.dtype() != DType::BF16 || !(copy.shape() == impl_->value.shape()))
    throw std::invalid_argument("set_bf16_copy: a bf16 tensor of shape " +
                                impl_->value.shape().str());
  impl_->bf16 = copy;
}

void Variable::cache_bf16_value(const Tensor& rounding) const {
  if (!impl_->op_output)
    throw std::invalid_argument("cache_bf16_value: only an op output's rounding is cached");
  if (rounding.dtype() != DType::BF16 || !(rounding.shape() == impl_->value.shape()))
    throw std::invalid_argument("cache_bf16_value: a bf16 tensor of shape " +
                                impl_->value.shape().str());
  impl_->bf16 = rounding;
}

const Tensor& Variable::grad() const {
  static const Tensor kUndefined;
  return impl_->grad ? impl_->grad->tensor() : kUndefined;
}

bool grad_enabled() {
  return g_grad_enabled;
}

NoGradGuard::NoGradGuard() : previous_(g_grad_enabled) {
  g_grad_enabled = false;
}
NoGradGuard::~NoGradGuard() {
  g_grad_enabled = previous_;
}

DType compute_dtype() {
  return g_compute_dtype;
}

ComputeDTypeGuard::ComputeDTypeGuard(DType dtype) : previous_(g_compute_dtype) {
  if (dtype != DType::F32 && dtype != DType::BF16)
    throw std::invalid_argument("compute dtype must be f32 or bf16");
  g_compute_dtype = dtype;
}
ComputeDTypeGuard::~ComputeDTypeGuard() {
  g_compute_dtype = previous_;
}

bool needs_grad(std::initializer_list<const Variable*> inputs) {
  if (!g_grad_enabled) return false;
  bool any = false;
  for (const Variable* v : inputs) any = any || v->requires_grad();
  if (!any) return false;
  for (const Variable* v : inputs)
    if (v->requires_grad()) v->grad_ref()->add_contribution();
  return true;
}

void record_backward(const char* op, std::function<void()> backward) {
  current_tape().push_back(TapeNode{op, std::move(backward)});
}

namespace {

void run_tape() {
  Tape& tape = current_tape();
  while (!tape.empty()) {
    TapeNode node = std::move(tape.back());
    tape.pop_back();
    profiler::Scope scope(node.op, profiler::Pass::Backward);
    node.backward();
  }
}

}  // namespace

void backward(const Variable& loss, float scale) {
  if (!loss.requires_grad()) throw std::logic_error("backward: loss does not require grad");
  if (loss.value().numel() != 1) throw std::logic_error("backward: loss is not a scalar");
  const Tensor& seed = loss.grad_ref()->get_or_zeros();
  if (!measuring()) seed.f32()[0] = scale;
  run_tape();
}

void backward(const Variable& output, const Tensor& grad_output) {
  if (!output.requires_grad()) throw std::logic_error("backward: output does not require grad");
  if (!(grad_output.shape() == output.shape()))
    throw std::logic_error("backward: gradient shape " + grad_output.shape().str() +
                           " differs from output " + output.shape().str());
  output.grad_ref()->get_or_zeros().copy_from(grad_output);
  run_tape();
}

void clear_tape() {
  current_tape().clear();
}
size_t tape_size() {
  return current_tape().size();
}

Variable checkpoint(std::function<Variable(const Variable&)> fn, const Variable& x) {
  return checkpoint([fn = std::move(fn)](const std::vector<Variable>& in) { return fn(in[0]); },
                    std::vector<Variable>{x});
}

Variable checkpoint(std::function<Variable(const std::vector<Variable>&)> fn,
                    const std::vector<Variable>& xs) {
  if (!g_grad_enabled) return fn(xs);
  Tensor y;
  {
    NoGradGuard no_grad;
    y = fn(xs).value();
  }
  Variable out = Variable::op_output(y, true);
  std::vector<Tensor> values;
  std::vector<GradRef> grads;
  for (const Variable& x : xs) {
    if (x.requires_grad()) x.grad_ref()->add_contribution();
    values.push_back(x.value());
    grads.push_back(x.grad_ref());
  }
  record_backward("checkpoint", [fn = std::move(fn), values = std::move(values),
                                 grads = std::move(grads), gy = out.grad_ref(),
                                 dtype = g_compute_dtype] {
    const Tensor& dy = gy->tensor();
    if (!dy.defined()) return;
    ComputeDTypeGuard precision(dtype);
    TapeScope tape;
    // The inputs enter as they did in the forward pass: outputs of ops.
    std::vector<Variable> in;
    for (size_t i = 0; i < values.size(); ++i)
      in.push_back(Variable::op_output(values[i], grads[i] != nullptr));
    Variable yr = fn(in);
    if (!yr.requires_grad()) return;  // nothing inside needs a gradient
    backward(yr, dy);
    for (size_t i = 0; i < values.size(); ++i) {
      const GradRef& gx = grads[i];
      if (!gx || !in[i].grad().defined()) continue;
      if (!gx->tensor().defined()) {
        gx->get_or_zeros().copy_from(in[i].grad());
      } else if (!measuring()) {
        kernels::vector_accumulate(gx->get_or_zeros().f32(), in[i].grad().f32(), values[i].numel());
      }
    }
  });
  return out;
}

TapeScope::TapeScope() {
  tapes().emplace_back();
}
TapeScope::~TapeScope() {
  tapes().pop_back();
}

}  // namespace cputrain
