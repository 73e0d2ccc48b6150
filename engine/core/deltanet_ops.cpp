#include "engine/core/deltanet_ops.h"

#include <algorithm>

#include "engine/core/op_support.h"
#include "engine/core/profiler.h"
#include "kernels/deltanet/causal_conv.h"
#include "kernels/deltanet/deltanet_ops.h"
#include "kernels/deltanet/gated_delta.h"

namespace cputrain {
namespace {

using namespace op_support;
using profiler::Pass;
using profiler::Scope;

int64_t last_dim(const Variable& x) {
  return x.shape()[x.shape().ndim() - 1];
}

// The kernels' view of `positions` (B, T) for x (B, T, ...): null where undefined or not
// computing.
const int32_t* packed_positions(const Tensor& positions, const Shape& xs) {
  if (!positions.defined()) return nullptr;
  require(positions.dtype() == DType::I32 && positions.numel() == xs[0] * xs[1],
          "positions (B, T) i32");
  return computing() ? positions.i32() : nullptr;
}

}  // namespace

Variable causal_conv_silu(const Variable& x, const Variable& w, Tensor* state,
                          const Tensor& positions) {
  const Shape& xs = x.shape();
  require(xs.ndim() == 3 && w.value().ndim() == 2 && w.shape()[0] == xs[2],
          "causal_conv_silu: x (B, T, C), w (C, K)");
  kernels::CausalConvShape s;
  s.batch = xs[0];
  s.length = xs[1];
  s.channels = xs[2];
  s.taps = w.shape()[1];
  s.positions = packed_positions(positions, xs);
  require(state == nullptr || s.positions == nullptr, "causal_conv_silu: a state or positions");
  Scope scope("causal conv", Pass::Forward);
  Tensor y = new_activation(xs);
  if (state != nullptr) {
    require(!needs_grad({&x, &w}) && state->numel() == s.state_elements(),
            "causal_conv_silu: a state (B, C, K - 1), without gradients");
    Tensor next = Tensor::empty(state->shape(), DType::F32, MemoryCategory::Workspace);
    if (computing()) {
      kernels::causal_conv_silu_forward<float>(s, fp32_value(x).f32(), w.value().f32(),
                                               state->f32(), y.f32());
      kernels::causal_conv_next_state<float>(s, fp32_value(x).f32(), state->f32(), next.f32());
      std::copy_n(next.f32(), next.numel(), state->f32());
    }
    return Variable(y, false);
  }
  if (computing())
    kernels::causal_conv_silu_forward_f32(s, fp32_value(x).f32(), w.value().f32(), y.f32());
  const bool grad = needs_grad({&x, &w});
  Variable out = Variable::op_output(y, grad);
  if (grad) {
    record_backward("causal conv", [xv = x.value(), wv = w.value(), gx = x.grad_ref(),
                                    gw = w.grad_ref(), gy = out.grad_ref(), s, xs, positions] {
      const Tensor& dy = gy->tensor();
      if (!dy.defined()) return;
      const OverwrittenGradient dx(gx, xs);
      Tensor dw = summed_gradient(gw, wv.shape());
      if (!computing()) return;
      kernels::causal_conv_silu_backward_f32(s, xv.f32(), wv.f32(), dy.f32(), dx.data(), dw.f32());
      dx.add_to_cell();
    });
  }
  return out;
}

Variable head_l2norm(const Variable& x, int64_t heads, float eps) {
  const int64_t C = last_dim(x);
  require(heads > 0 && C % heads == 0, "head_l2norm: x (..., H * D)");
  const int64_t D = C / heads, N = x.value().numel() / D;
  Scope scope("l2norm", Pass::Forward);
  Tensor y = new_activation(x.shape()), rnorm = new_activation(Shape{N});
  if (computing()) kernels::l2norm_forward(y.f32(), rnorm.f32(), fp32_value(x).f32(), N, D, eps);
  const bool grad = needs_grad({&x});
  Variable out = Variable::op_output(y, grad);
  if (grad) {
    record_backward("l2norm",
                    [y, rnorm, gx = x.grad_ref(), gy = out.grad_ref(), N, D, xs = x.shape()] {
                      const Tensor& dy = gy->tensor();
                      if (!dy.defined()) return;
                      const KernelGrads g = kernel_grads({{&gx, xs}});
                      if (computing())
                        kernels::l2norm_backward(g.grads[0].f32(), dy.f32(), y.f32(), rnorm.f32(),
                                                 N, D, g.accumulate);
                    });
  }
  return out;
}

Variable deltanet_decay(const Variable& a, const Variable& a_log, const Variable& dt_bias) {
  const int64_t H = last_dim(a), N = a.value().numel() / H;
  require(a_log.value().numel() == H && dt_bias.value().numel() == H,
          "deltanet_decay: a (..., H), a_log and dt_bias (H)");
  Scope scope("deltanet decay", Pass::Forward);
  Tensor g = new_activation(a.shape());
  if (computing())
    kernels::deltanet_decay_forward(g.f32(), fp32_value(a).f32(), a_log.value().f32(),
                                    dt_bias.value().f32(), N, H);
  const bool grad = needs_grad({&a, &a_log, &dt_bias});
  Variable out = Variable::op_output(g, grad);
  if (grad) {
    record_backward("deltanet decay", [av = a.value(), lv = a_log.value(), bv = dt_bias.value(),
                                       ga = a.grad_ref(), gl = a_log.grad_ref(),
                                       gb = dt_bias.grad_ref(), gy = out.grad_ref(), N, H] {
      const Tensor& dy = gy->tensor();
      if (!dy.defined()) return;
      const KernelGrads g = kernel_grads({{&ga, av.shape()}});
      Tensor dl = summed_gradient(gl, lv.shape()), db = summed_gradient(gb, bv.shape());
      if (computing())
        kernels::deltanet_decay_backward(g.grads[0].f32(), dl.f32(), db.f32(), dy.f32(), av.f32(),
                                         lv.f32(), bv.f32(), N, H, g.accumulate);
    });
  }
  return out;
}

namespace {

Variable sigmoid_op(const Variable& x, const Variable* gate) {
  require(gate == nullptr || gate->shape() == x.shape(), "sigmoid_gated: equal shapes");
  const int64_t n = x.value().numel();
  Scope scope(gate != nullptr ? "sigmoid gate" : "sigmoid", Pass::Forward);
  Tensor y = new_activation(x.shape());
  const Tensor gv = gate != nullptr ? fp32_value(*gate) : Tensor();
  // In bf16 mode the gated x may be an output only GEMMs read (attention's), held as its bf16
  // rounding alone: widened, and kept for the backward pass.
  const Tensor xv = as_f32(x.value(), MemoryCategory::Activations);
  if (computing())
    kernels::sigmoid_gate_forward(y.f32(), xv.f32(), gv.defined() ? gv.f32() : nullptr, n);
  const bool grad = gate != nullptr ? needs_grad({&x, gate}) : needs_grad({&x});
  Variable out = Variable::op_output(y, grad);
  if (grad) {
    const GradRef gg = gate != nullptr ? gate->grad_ref() : GradRef();
    record_backward(
        "sigmoid", [xv, gv, gx = x.grad_ref(), gg, gy = out.grad_ref(), n, xs = x.shape()] {
          const Tensor& dy = gy->tensor();
          if (!dy.defined()) return;
          const KernelGrads g =
              gv.defined() ? kernel_grads({{&gx, xs}, {&gg, xs}}) : kernel_grads({{&gx, xs}});
          if (computing())
            kernels::sigmoid_gate_backward(
                g.grads[0].f32(), gv.defined() ? g.grads[1].f32() : nullptr, dy.f32(), xv.f32(),
                gv.defined() ? gv.f32() : nullptr, n, g.accumulate);
        });
  }
  return out;
}

}  // namespace

Variable sigmoid(const Variable& x) {
  return sigmoid_op(x, nullptr);
}

Variable sigmoid_gated(const Variable& x, const Variable& gate) {
  return sigmoid_op(x, &gate);
}

Variable gated_delta_rule(const Variable& q, const Variable& k, const Variable& v,
                          const Variable& g, const Variable& beta, int64_t key_heads,
                          int64_t value_heads, float scale, Tensor* state, int64_t chunk,
                          const Tensor& positions) {
  const Shape& qs = q.shape();
  require(qs.ndim() == 3 && k.shape() == qs && v.shape().ndim() == 3 && key_heads > 0 &&
              value_heads % key_heads == 0 && qs[2] % key_heads == 0 &&
              v.shape()[2] % value_heads == 0 && g.shape() == beta.shape() &&
              g.value().numel() == qs[0] * qs[1] * value_heads,
          "gated_delta_rule: q, k (B, T, Hk * dk), v (B, T, Hv * dv), g and beta (B, T, Hv)");
  kernels::GatedDeltaShape s;
  s.batch = qs[0];
  s.length = qs[1];
  s.key_heads = key_heads;
  s.value_heads = value_heads;
  s.key_dim = qs[2] / key_heads;
  s.value_dim = v.shape()[2] / value_heads;
  s.chunk = chunk;
  s.positions = packed_positions(positions, qs);
  s.bf16_products = bf16_mode();
  require(state == nullptr || s.positions == nullptr, "gated_delta_rule: a state or positions");
  Scope scope("gated delta rule", Pass::Forward);
  Tensor y = new_activation(v.shape());
  if (state != nullptr) {
    require(!needs_grad({&q, &k, &v, &g, &beta}) && state->numel() == s.state_elements(),
            "gated_delta_rule: a state (B, Hv, dk, dv), without gradients");
    if (computing())
      kernels::gated_delta_recurrent<float>(s, scale, fp32_value(q).f32(), fp32_value(k).f32(),
                                            fp32_value(v).f32(), fp32_value(g).f32(),
                                            fp32_value(beta).f32(), state->f32(), y.f32());
    return Variable(y, false);
  }
  Tensor states = new_activation(Shape{s.saved_state_elements()});
  if (computing())
    kernels::gated_delta_chunked_forward<float>(
        s, scale, fp32_value(q).f32(), fp32_value(k).f32(), fp32_value(v).f32(),
        fp32_value(g).f32(), fp32_value(beta).f32(), nullptr, states.f32(), y.f32());
  const bool grad = needs_grad({&q, &k, &v, &g, &beta});
  Variable out = Variable::op_output(y, grad);
  if (!grad) return out;
  record_backward("gated delta rule", [s, scale, qv = q.value(), kv = k.value(), vv = v.value(),
                                       gv = g.value(), bv = beta.value(), states, gq = q.grad_ref(),
                                       gk = k.grad_ref(), gvv = v.grad_ref(), gg = g.grad_ref(),
                                       gb = beta.grad_ref(), gy = out.grad_ref(), positions] {
    const Tensor& dy = gy->tensor();
    if (!dy.defined()) return;
    const OverwrittenGradient dq(gq, qv.shape()), dk(gk, kv.shape()), dv(gvv, vv.shape()),
        dg(gg, gv.shape()), db(gb, bv.shape());
    if (!computing()) return;
    kernels::gated_delta_chunked_backward<float>(
        s, scale, qv.f32(), kv.f32(), vv.f32(), gv.f32(), bv.f32(), states.f32(), dy.f32(), nullptr,
        dq.data(), dk.data(), dv.data(), dg.data(), db.data(), nullptr);
    for (const OverwrittenGradient* d : {&dq, &dk, &dv, &dg, &db}) d->add_to_cell();
  });
  return out;
}

Variable gated_head_rmsnorm(const Variable& x, const Variable& z, const Variable& w, int64_t heads,
                            float eps) {
  const int64_t C = last_dim(x);
  require(heads > 0 && C % heads == 0 && z.shape() == x.shape() && w.value().numel() == C / heads,
          "gated_head_rmsnorm: x and z (..., H * D), w (D)");
  const int64_t D = C / heads, N = x.value().numel() / D;
  Scope scope("gated rmsnorm", Pass::Forward);
  Tensor y = new_activation(x.shape()), rstd = new_activation(Shape{N});
  if (computing())
    kernels::gated_rmsnorm_forward(y.f32(), rstd.f32(), fp32_value(x).f32(), fp32_value(z).f32(),
                                   w.value().f32(), N, D, eps);
  const bool grad = needs_grad({&x, &z, &w});
  Variable out = Variable::op_output(y, grad);
  if (grad) {
    record_backward("gated rmsnorm", [xv = x.value(), zv = z.value(), wv = w.value(), rstd,
                                      gx = x.grad_ref(), gz = z.grad_ref(), gw = w.grad_ref(),
                                      gy = out.grad_ref(), N, D, xs = x.shape()] {
      const Tensor& dy = gy->tensor();
      if (!dy.defined()) return;
      const KernelGrads g = kernel_grads({{&gx, xs}, {&gz, xs}});
      Tensor dw = summed_gradient(gw, wv.shape());
      if (computing())
        kernels::gated_rmsnorm_backward(g.grads[0].f32(), g.grads[1].f32(), dw.f32(), dy.f32(),
                                        xv.f32(), zv.f32(), wv.f32(), rstd.f32(), N, D,
                                        g.accumulate);
    });
  }
  return out;
}

}  // namespace cputrain
