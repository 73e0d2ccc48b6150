#include "engine/ops.h"

#include <cmath>
#include <stdexcept>

#include "kernels/attention.h"
#include "kernels/cross_entropy.h"
#include "kernels/embedding.h"
#include "kernels/gemm.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"
#include "kernels/swiglu.h"
#include "kernels/vector_add.h"

namespace cputrain {
namespace {

using kernels::Transpose;

Tensor new_activation(const Shape& shape) {
  return Tensor::empty(shape, DType::F32, MemoryCategory::Activations);
}

// Shape of x with its last dimension replaced by n.
Shape with_last_dim(const Shape& x, int64_t n) {
  switch (x.ndim()) {
    case 1: return Shape{n};
    case 2: return Shape{x[0], n};
    case 3: return Shape{x[0], x[1], n};
    default: return Shape{x[0], x[1], x[2], n};
  }
}

void require(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(what);
}

}  // namespace

Variable embedding(const Variable& table, const Tensor& tokens) {
  require(table.value().ndim() == 2 && tokens.ndim() == 2 && tokens.dtype() == DType::I32,
          "embedding: table (V, C) and tokens (B, T) i32");
  const int64_t C = table.shape()[1];
  const int64_t N = tokens.numel();
  Tensor y = new_activation(Shape{tokens.dim(0), tokens.dim(1), C});
  kernels::embedding_forward(y.f32(), tokens.i32(), table.value().f32(), N, C);
  const bool grad = needs_grad({&table});
  Variable out(y, grad);
  if (grad) {
    record_backward([tokens, gt = table.grad_ref(), gy = out.grad_ref(), N, C] {
      if (!gy->tensor().defined()) return;
      kernels::embedding_backward(gt->get_or_zeros().f32(), gy->tensor().f32(), tokens.i32(), N,
                                  C);
    });
  }
  return out;
}

Variable linear(const Variable& x, const Variable& w) {
  const Shape& xs = x.shape();
  require(w.value().ndim() == 2 && xs[xs.ndim() - 1] == w.shape()[1],
          "linear: x (..., K) and w (N, K)");
  const int64_t N = w.shape()[0];
  const int64_t K = w.shape()[1];
  const int64_t M = x.value().numel() / K;
  Tensor y = new_activation(with_last_dim(xs, N));
  kernels::gemm_f32(Transpose::No, Transpose::Yes, M, N, K, x.value().f32(), K, w.value().f32(),
                    K, 0.0f, y.f32(), N);
  const bool grad = needs_grad({&x, &w});
  Variable out(y, grad);
  if (grad) {
    // The gradient of x needs w and that of w needs x: save only what is used.
    Tensor xv = w.requires_grad() ? x.value() : Tensor();
    Tensor wv = x.requires_grad() ? w.value() : Tensor();
    record_backward([xv, wv, gx = x.grad_ref(), gw = w.grad_ref(), gy = out.grad_ref(), M, N, K] {
      const Tensor& dy = gy->tensor();
      if (!dy.defined()) return;
      if (gx) {
        kernels::gemm_f32(Transpose::No, Transpose::No, M, K, N, dy.f32(), N, wv.f32(), K, 1.0f,
                          gx->get_or_zeros().f32(), K);
      }
      if (gw) {
        kernels::gemm_f32(Transpose::Yes, Transpose::No, N, K, M, dy.f32(), N, xv.f32(), K, 1.0f,
                          gw->get_or_zeros().f32(), K);
      }
    });
  }
  return out;
}

Variable rmsnorm(const Variable& x, const Variable& w, float eps) {
  const Shape& xs = x.shape();
  const int64_t C = xs[xs.ndim() - 1];
  require(w.value().ndim() == 1 && w.shape()[0] == C, "rmsnorm: x (..., C) and w (C)");
  const int64_t N = x.value().numel() / C;
  Tensor y = new_activation(xs);
  Tensor rstd = new_activation(Shape{N});
  kernels::rmsnorm_forward(y.f32(), rstd.f32(), x.value().f32(), w.value().f32(), N, C, eps);
  const bool grad = needs_grad({&x, &w});
  Variable out(y, grad);
  if (grad) {
    record_backward([xv = x.value(), wv = w.value(), rstd, gx = x.grad_ref(), gw = w.grad_ref(),
                     gy = out.grad_ref(), N, C] {
      const Tensor& dy = gy->tensor();
      if (!dy.defined()) return;
      // The kernel produces both gradients; a side nobody needs goes to scratch.
      Tensor dx = gx ? gx->get_or_zeros()
                     : Tensor::zeros(Shape{N, C}, DType::F32, MemoryCategory::Workspace);
      Tensor dw = gw ? gw->get_or_zeros()
                     : Tensor::zeros(Shape{C}, DType::F32, MemoryCategory::Workspace);
      kernels::rmsnorm_backward(dx.f32(), dw.f32(), dy.f32(), xv.f32(), wv.f32(), rstd.f32(), N,
                                C);
    });
  }
  return out;
}

Variable rope(const Variable& x, const Tensor& table, int64_t n_heads) {
  const Shape& xs = x.shape();
  require(xs.ndim() == 3 && xs[2] % n_heads == 0 && (xs[2] / n_heads) % 2 == 0,
          "rope: x (B, T, C) with C = H * D, D even");
  const int64_t B = xs[0], T = xs[1], H = n_heads, D = xs[2] / n_heads;
  require(table.numel() >= T * D, "rope: table shorter than T");
  Tensor y = new_activation(xs);
  kernels::rope_forward(y.f32(), x.value().f32(), table.f32(), B, T, H, D);
  const bool grad = needs_grad({&x});
  Variable out(y, grad);
  if (grad) {
    record_backward([table, gx = x.grad_ref(), gy = out.grad_ref(), B, T, H, D] {
      if (!gy->tensor().defined()) return;
      kernels::rope_backward(gx->get_or_zeros().f32(), gy->tensor().f32(), table.f32(), B, T, H,
                             D);
    });
  }
  return out;
}

Variable attention(const Variable& q, const Variable& k, const Variable& v, int64_t n_heads) {
  const Shape& s = q.shape();
  require(s.ndim() == 3 && k.shape() == s && v.shape() == s && s[2] % n_heads == 0,
          "attention: q, k, v (B, T, C) with C = H * D");
  const int64_t B = s[0], T = s[1], H = n_heads, D = s[2] / n_heads;
  Tensor y = new_activation(s);
  Tensor lse = new_activation(Shape{B, H, T});
  kernels::attention_forward(y.f32(), lse.f32(), q.value().f32(), k.value().f32(),
                             v.value().f32(), B, T, H, D);
  const bool grad = needs_grad({&q, &k, &v});
  Variable out(y, grad);
  if (grad) {
    record_backward([qv = q.value(), kv = k.value(), vv = v.value(), y, lse, gq = q.grad_ref(),
                     gk = k.grad_ref(), gv = v.grad_ref(), gy = out.grad_ref(), B, T, H, D] {
      const Tensor& dy = gy->tensor();
      if (!dy.defined()) return;
      auto grad_or_scratch = [&](const GradRef& g) {
        return g ? g->get_or_zeros()
                 : Tensor::zeros(Shape{B, T, H * D}, DType::F32, MemoryCategory::Workspace);
      };
      Tensor dq = grad_or_scratch(gq), dk = grad_or_scratch(gk), dv = grad_or_scratch(gv);
      kernels::attention_backward(dq.f32(), dk.f32(), dv.f32(), dy.f32(), qv.f32(), kv.f32(),
                                  vv.f32(), y.f32(), lse.f32(), B, T, H, D);
    });
  }
  return out;
}

Variable swiglu(const Variable& gate, const Variable& up) {
  require(gate.shape() == up.shape(), "swiglu: gate and up of equal shape");
  const int64_t n = gate.value().numel();
  Tensor y = new_activation(gate.shape());
  kernels::swiglu_forward(y.f32(), gate.value().f32(), up.value().f32(), n);
  const bool grad = needs_grad({&gate, &up});
  Variable out(y, grad);
  if (grad) {
    record_backward([gv = gate.value(), uv = up.value(), gg = gate.grad_ref(),
                     gu = up.grad_ref(), gy = out.grad_ref(), n] {
      const Tensor& dy = gy->tensor();
      if (!dy.defined()) return;
      auto grad_or_scratch = [&](const GradRef& g) {
        return g ? g->get_or_zeros() : Tensor::zeros(Shape{n}, DType::F32, MemoryCategory::Workspace);
      };
      Tensor dg = grad_or_scratch(gg), du = grad_or_scratch(gu);
      kernels::swiglu_backward(dg.f32(), du.f32(), dy.f32(), gv.f32(), uv.f32(), n);
    });
  }
  return out;
}

Variable add(const Variable& a, const Variable& b) {
  require(a.shape() == b.shape(), "add: equal shapes");
  const int64_t n = a.value().numel();
  Tensor y = new_activation(a.shape());
  kernels::vector_add(y.f32(), a.value().f32(), b.value().f32(), n);
  const bool grad = needs_grad({&a, &b});
  Variable out(y, grad);
  if (grad) {
    record_backward([ga = a.grad_ref(), gb = b.grad_ref(), gy = out.grad_ref(), n] {
      const Tensor& dy = gy->tensor();
      if (!dy.defined()) return;
      if (ga) kernels::vector_accumulate(ga->get_or_zeros().f32(), dy.f32(), n);
      if (gb) kernels::vector_accumulate(gb->get_or_zeros().f32(), dy.f32(), n);
    });
  }
  return out;
}

Variable cross_entropy(const Variable& logits, const Tensor& targets) {
  const Shape& ls = logits.shape();
  const int64_t V = ls[ls.ndim() - 1];
  const int64_t N = logits.value().numel() / V;
  require(targets.dtype() == DType::I32 && targets.numel() == N,
          "cross_entropy: one i32 target per row of logits");
  Tensor losses = Tensor::empty(Shape{N}, DType::F32, MemoryCategory::Workspace);
  Tensor lse = new_activation(Shape{N});
  kernels::cross_entropy_forward(losses.f32(), lse.f32(), logits.value().f32(), targets.i32(), N,
                                 V);
  double sum = 0.0;
  for (int64_t i = 0; i < N; ++i) sum += losses.f32()[i];
  Tensor y = new_activation(Shape{1});
  y.f32()[0] = static_cast<float>(sum / static_cast<double>(N));
  const bool grad = needs_grad({&logits});
  Variable out(y, grad);
  if (grad) {
    record_backward([lv = logits.value(), lse, targets, gl = logits.grad_ref(),
                     gy = out.grad_ref(), N, V] {
      const Tensor& dy = gy->tensor();
      if (!dy.defined()) return;
      Tensor dlosses = Tensor::empty(Shape{N}, DType::F32, MemoryCategory::Workspace);
      const float each = dy.f32()[0] / static_cast<float>(N);
      for (int64_t i = 0; i < N; ++i) dlosses.f32()[i] = each;
      kernels::cross_entropy_backward(gl->get_or_zeros().f32(), lv.f32(), lse.f32(),
                                      targets.i32(), dlosses.f32(), N, V);
    });
  }
  return out;
}

}  // namespace cputrain
