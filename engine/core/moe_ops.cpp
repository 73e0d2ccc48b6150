#include "engine/core/moe_ops.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "engine/core/op_support.h"
#include "engine/core/profiler.h"
#include "kernels/cpu/bf16.h"
#include "kernels/gemm/gemm.h"
#include "kernels/ops/swiglu.h"
#include "kernels/quant/quant.h"

namespace cputrain {
namespace {

using namespace op_support;
using kernels::Transpose;
using profiler::Pass;
using profiler::Scope;

// C (M x N) = op(A) op(B) + beta C on rows of a and b from element offsets a0 and b0 (bf16 or
// FP32 as a is; b of the same type), leading dimensions lda, ldb, ldc.
void product(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K, const Tensor& a,
             int64_t a0, int64_t lda, const Tensor& b, int64_t b0, int64_t ldb, float beta,
             float* c, int64_t ldc) {
  if (a.dtype() == DType::BF16)
    kernels::gemm_bf16(ta, tb, M, N, K, a.bf16() + a0, lda, b.bf16() + b0, ldb, beta, c, ldc);
  else
    kernels::gemm_f32(ta, tb, M, N, K, a.f32() + a0, lda, b.f32() + b0, ldb, beta, c, ldc);
}

// Expert e's (rows, cols) matrix of w (E, rows, cols: bf16, FP32 or quantised).
kernels::QuantMatrix expert_quant(const Tensor& w, int64_t e, int64_t rows, int64_t cols) {
  kernels::QuantMatrix q{quant_type(w.dtype()), nullptr, rows, cols};
  q.data = static_cast<const uint8_t*>(w.raw()) + e * rows * q.row_bytes();
  return q;
}

// out (n, rows) = X W_e^T for X the n rows of x (of cols elements, bf16 or FP32) from row x0.
void expert_forward(const Tensor& w, int64_t e, int64_t rows, int64_t cols, int64_t n,
                    const Tensor& x, int64_t x0, float* out) {
  const bool bf16 = x.dtype() == DType::BF16;
  if (!dtype_quantized(w.dtype()))
    return product(Transpose::No, Transpose::Yes, n, rows, cols, x, x0 * cols, cols, w,
                   e * rows * cols, cols, 0.0f, out, rows);
  const kernels::QuantMatrix q = expert_quant(w, e, rows, cols);
  if (bf16)
    kernels::gemm_quant_forward_bf16(n, x.bf16() + x0 * cols, cols, q, 0.0f, out, rows);
  else
    kernels::gemm_quant_forward(n, x.f32() + x0 * cols, cols, q, 0.0f, out, rows);
}

// dx (n, cols) = dY W_e + beta dx for dY the n rows of dy (of rows elements) from row d0.
void expert_input(const Tensor& w, int64_t e, int64_t rows, int64_t cols, int64_t n,
                  const Tensor& dy, int64_t d0, float beta, float* dx) {
  const bool bf16 = dy.dtype() == DType::BF16;
  if (!dtype_quantized(w.dtype()))
    return product(Transpose::No, Transpose::No, n, cols, rows, dy, d0 * rows, rows, w,
                   e * rows * cols, cols, beta, dx, cols);
  const kernels::QuantMatrix q = expert_quant(w, e, rows, cols);
  if (bf16)
    kernels::gemm_quant_backward_input_bf16(n, dy.bf16() + d0 * rows, rows, q, beta, dx, cols);
  else
    kernels::gemm_quant_backward_input(n, dy.f32() + d0 * rows, rows, q, beta, dx, cols);
}

// While measuring: the allocations of the products by w of all R rows at once.
void measure_expert(const Tensor& w, bool bf16, bool forward, int64_t R, int64_t rows,
                    int64_t cols) {
  if (dtype_quantized(w.dtype()))
    measure_quant_gemm(bf16, forward, R, rows, cols);
  else if (forward)
    measure_gemm(bf16, Transpose::No, Transpose::Yes, R, rows, cols);
  else
    measure_gemm(bf16, Transpose::No, Transpose::No, R, cols, rows);
}

// Rows of `src` (of C elements; bf16 or FP32) into `dst` (rows x C, the same type): row r of dst
// is row rows[r] / k of src (rows: the grouped (token, slot) indices).
void gather_rows(Tensor& dst, const Tensor& src, const int32_t* rows, int64_t n, int64_t k,
                 int64_t C) {
  const size_t bytes = dtype_size(src.dtype()) * static_cast<size_t>(C);
  const auto* s = static_cast<const char*>(src.raw());
  auto* d = static_cast<char*>(dst.raw());
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; ++r)
    std::copy_n(s + static_cast<size_t>(rows[r] / k) * bytes, bytes,
                d + static_cast<size_t>(r) * bytes);
}

// The grouping of a routing: each expert's rows at order[offsets[e] .. offsets[e + 1]), and
// where each (token, slot) pair's row is (position[token * k + slot]).
struct Grouping {
  std::vector<int64_t> offsets;
  Tensor order, position;  // (N k) I32 each
};

}  // namespace

MoeRouting moe_route(const Variable& logits, int64_t k, kernels::MoeGating gating, bool normalize) {
  const int64_t E = logits.shape()[logits.shape().ndim() - 1];
  const int64_t N = logits.value().numel() / E;
  require(k > 0 && k <= E, "moe_route: 0 < k <= E");
  Scope scope("moe route", Pass::Forward);
  const bool grad = needs_grad({&logits});
  const bool softmax = gating == kernels::MoeGating::Softmax;
  Tensor probs = new_activation(softmax ? Shape{N, E} : Shape{1});
  Tensor experts = new_activation(Shape{N, k}, DType::I32);
  Tensor weights = new_activation(Shape{N, k});
  if (computing())
    kernels::moe_route_forward(fp32_value(logits).f32(), N, E, k, gating, normalize, probs.f32(),
                               experts.i32(), weights.f32());
  MoeRouting out{Variable::op_output(weights, grad), experts};
  if (grad) {
    record_backward("moe route", [probs, experts, weights, gl = logits.grad_ref(),
                                  gw = out.weights.grad_ref(), N, E, k, gating, normalize] {
      const Tensor& dw = gw->tensor();
      if (!dw.defined()) return;
      const OverwrittenGradient dl(gl, Shape{N, E});
      if (!computing()) return;
      kernels::moe_route_backward(probs.f32(), experts.i32(), weights.f32(), as_f32(dw).f32(), N, E,
                                  k, gating, normalize, dl.data());
      dl.add_to_cell();
    });
  }
  return out;
}

Variable moe_experts(const Variable& x, const Variable& w1, const Variable& w3, const Variable& w2,
                     const MoeRouting& route) {
  const Shape& xs = x.shape();
  const int64_t C = xs[xs.ndim() - 1], N = x.value().numel() / C;
  require(w1.value().ndim() == 3 && w1.shape() == w3.shape() && w1.shape()[2] == C &&
              w2.value().ndim() == 3 && w2.shape()[0] == w1.shape()[0] && w2.shape()[1] == C &&
              w2.shape()[2] == w1.shape()[1],
          "moe_experts: x (..., C), w1 and w3 (E, F, C), w2 (E, C, F)");
  const int64_t E = w1.shape()[0], F = w1.shape()[1], k = route.experts.shape()[1];
  require(route.experts.numel() == N * k && route.weights.value().numel() == N * k,
          "moe_experts: a routing of x's rows");
  Scope scope("moe experts", Pass::Forward);
  const bool bf16 = bf16_mode();
  const DType operand = bf16 ? DType::BF16 : DType::F32;
  const Tensor xv = bf16 ? x.bf16_value() : fp32_value(x);
  const Tensor w1v = weight_operand(w1, bf16), w3v = weight_operand(w3, bf16),
               w2v = weight_operand(w2, bf16);
  require((!dtype_quantized(w1v.dtype()) || !w1.requires_grad()) &&
              (!dtype_quantized(w3v.dtype()) || !w3.requires_grad()) &&
              (!dtype_quantized(w2v.dtype()) || !w2.requires_grad()),
          "moe_experts: a quantised expert takes no gradient");
  const int64_t R = N * k;  // rows of the grouped products
  auto group = std::make_shared<Grouping>();
  group->offsets.assign(static_cast<size_t>(E + 1), 0);
  group->order = new_activation(Shape{R}, DType::I32);
  group->position = new_activation(Shape{R}, DType::I32);
  if (computing()) {
    kernels::moe_group(route.experts.i32(), N, k, E, group->offsets.data(), group->order.i32());
    for (int64_t r = 0; r < R; ++r)
      group->position.i32()[group->order.i32()[r]] = static_cast<int32_t>(r);
  }
  const std::vector<int64_t>& off = group->offsets;
  Tensor xg = Tensor::empty(Shape{R, C}, operand, MemoryCategory::Workspace);
  if (computing()) gather_rows(xg, xv, group->order.i32(), R, k, C);
  // The gate and up products, kept for the backward pass.
  Tensor G = new_activation(Shape{R, F}), U = new_activation(Shape{R, F});
  {
    Scope gemms("moe GEMMs gate, up", Pass::Forward, 2 * gemm_flops(R, F, C));
    if (!computing()) measure_expert(w1v, bf16, true, R, F, C);
    for (int64_t e = 0; computing() && e < E; ++e) {
      const int64_t n = off[e + 1] - off[e];
      if (n == 0) continue;
      expert_forward(w1v, e, F, C, n, xg, off[e], G.f32() + off[e] * F);
      expert_forward(w3v, e, F, C, n, xg, off[e], U.f32() + off[e] * F);
    }
  }
  xg = Tensor();
  Tensor H = Tensor::empty(Shape{R, F}, operand, MemoryCategory::Workspace);
  if (computing()) {
    if (bf16)
      kernels::swiglu_forward_bf16(H.bf16(), nullptr, nullptr, G.f32(), U.f32(), R * F);
    else
      kernels::swiglu_forward(H.f32(), G.f32(), U.f32(), R * F);
  }
  Tensor Y = Tensor::empty(Shape{R, C}, DType::F32, MemoryCategory::Workspace);
  {
    Scope gemms("moe GEMMs down", Pass::Forward, gemm_flops(R, C, F));
    if (!computing()) measure_expert(w2v, bf16, true, R, C, F);
    for (int64_t e = 0; computing() && e < E; ++e) {
      const int64_t n = off[e + 1] - off[e];
      if (n > 0) expert_forward(w2v, e, C, F, n, H, off[e], Y.f32() + off[e] * C);
    }
  }
  H = Tensor();
  Tensor y = new_activation(xs);
  const Tensor& wt = route.weights.value();
  if (computing()) {
    const int32_t* pos = group->position.i32();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < N; ++t) {
      float* out = y.f32() + t * C;
      std::fill_n(out, C, 0.0f);
      for (int64_t j = 0; j < k; ++j) {
        const float w = wt.f32()[t * k + j];
        const float* row = Y.f32() + static_cast<int64_t>(pos[t * k + j]) * C;
        for (int64_t c = 0; c < C; ++c) out[c] += w * row[c];
      }
    }
  }
  const bool grad = needs_grad({&x, &w1, &w3, &w2, &route.weights});
  Variable out = Variable::op_output(y, grad);
  if (!grad) return out;
  record_backward("moe experts", [group, G, U, xv, w1v, w3v, w2v, wt, gx = x.grad_ref(),
                                  g1 = w1.grad_ref(), g3 = w3.grad_ref(), g2 = w2.grad_ref(),
                                  gw = route.weights.grad_ref(), gy = out.grad_ref(), N, C, E, F, k,
                                  R, bf16, operand] {
    const Tensor& dyt = gy->tensor();
    if (!dyt.defined()) return;
    const Tensor dy = as_f32(dyt);
    const std::vector<int64_t>& off = group->offsets;
    const int32_t* order = group->order.i32();
    Scope scope("moe experts", Pass::Backward);
    // Each row's output gradient, unweighted, in the products' precision.
    Tensor dyg = Tensor::empty(Shape{R, C}, operand, MemoryCategory::Workspace);
    if (computing()) {
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < R; ++r) {
        const float* src = dy.f32() + static_cast<int64_t>(order[r] / k) * C;
        if (bf16)
          kernels::fp32_to_bf16_array(dyg.bf16() + r * C, src, C);
        else
          std::copy_n(src, C, dyg.f32() + r * C);
      }
    }
    // P = dY w2[e] (R x F), the gradient of the activation before the weight.
    Tensor P = Tensor::empty(Shape{R, F}, DType::F32, MemoryCategory::Workspace);
    {
      Scope gemms("moe GEMMs dH", Pass::Backward, gemm_flops(R, F, C));
      if (!computing()) measure_expert(w2v, bf16, false, R, C, F);
      for (int64_t e = 0; computing() && e < E; ++e) {
        const int64_t n = off[e + 1] - off[e];
        if (n > 0) expert_input(w2v, e, C, F, n, dyg, off[e], 0.0f, P.f32() + off[e] * F);
      }
    }
    // The activation again (as the down product took it), the weights' gradient (H . P) and
    // dH = weight P.
    Tensor H = Tensor::empty(Shape{R, F}, operand, MemoryCategory::Workspace);
    Tensor dweights = Tensor::empty(Shape{N, k}, DType::F32, MemoryCategory::Workspace);
    if (computing()) {
      if (bf16)
        kernels::swiglu_forward_bf16(H.bf16(), nullptr, nullptr, G.f32(), U.f32(), R * F);
      else
        kernels::swiglu_forward(H.f32(), G.f32(), U.f32(), R * F);
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < R; ++r) {
        float* p = P.f32() + r * F;
        double dot = 0;
        for (int64_t f = 0; f < F; ++f)
          dot += static_cast<double>(bf16 ? kernels::bf16_to_fp32(H.bf16()[r * F + f])
                                          : H.f32()[r * F + f]) *
                 p[f];
        dweights.f32()[order[r]] = static_cast<float>(dot);
        const float w = wt.f32()[order[r]];
        for (int64_t f = 0; f < F; ++f) p[f] *= w;
      }
    }
    if (gw) {
      float beta = 0.0f;
      float* d = gw->get_for_accumulate(&beta).f32();
      if (computing())
        // beta 0: d holds garbage, which is not to be read (0 times NaN is NaN).
        for (int64_t i = 0; i < N * k; ++i)
          d[i] = beta == 0.0f ? dweights.f32()[i] : dweights.f32()[i] + d[i];
    }
    if (g2) {
      // dW2[e] += (weight dY)^T H.
      const Tensor& dw2 = g2->get_or_zeros();
      if (computing()) {
#pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < R; ++r) {
          const float w = wt.f32()[order[r]];
          if (bf16) {
            const float* src = dy.f32() + static_cast<int64_t>(order[r] / k) * C;
            for (int64_t c = 0; c < C; ++c)
              dyg.bf16()[r * C + c] = kernels::fp32_to_bf16(w * src[c]);
          } else {
            for (int64_t c = 0; c < C; ++c) dyg.f32()[r * C + c] *= w;
          }
        }
      }
      Scope gemms("moe GEMMs dW2", Pass::Backward, gemm_flops(C, F, R));
      if (!computing()) measure_gemm(bf16, Transpose::Yes, Transpose::No, C, F, R);
      for (int64_t e = 0; computing() && e < E; ++e) {
        const int64_t n = off[e + 1] - off[e];
        if (n > 0)
          product(Transpose::Yes, Transpose::No, C, F, n, dyg, off[e] * C, C, H, off[e] * F, F,
                  1.0f, dw2.f32() + e * C * F, F);
      }
    }
    dyg = Tensor();
    H = Tensor();
    // dG, dU from dH (P), in the products' precision.
    Tensor dG = Tensor::empty(Shape{R, F}, operand, MemoryCategory::Workspace);
    Tensor dU = Tensor::empty(Shape{R, F}, operand, MemoryCategory::Workspace);
    if (computing()) {
      if (bf16) {
        Tensor dg32 = Tensor::empty(Shape{R, F}, DType::F32, MemoryCategory::Workspace);
        Tensor du32 = Tensor::empty(Shape{R, F}, DType::F32, MemoryCategory::Workspace);
        kernels::swiglu_backward(dg32.f32(), du32.f32(), P.f32(), G.f32(), U.f32(), R * F, false);
        kernels::fp32_to_bf16_array(dG.bf16(), dg32.f32(), R * F);
        kernels::fp32_to_bf16_array(dU.bf16(), du32.f32(), R * F);
      } else {
        kernels::swiglu_backward(dG.f32(), dU.f32(), P.f32(), G.f32(), U.f32(), R * F, false);
      }
    }
    P = Tensor();
    if (g1 || g3) {
      Tensor xg = Tensor::empty(Shape{R, C}, operand, MemoryCategory::Workspace);
      if (computing()) gather_rows(xg, xv, order, R, k, C);
      Scope gemms("moe GEMMs dW1, dW3", Pass::Backward, 2 * gemm_flops(F, C, R));
      if (!computing()) measure_gemm(bf16, Transpose::Yes, Transpose::No, F, C, R);
      const Tensor* dw1 = g1 ? &g1->get_or_zeros() : nullptr;
      const Tensor* dw3 = g3 ? &g3->get_or_zeros() : nullptr;
      for (int64_t e = 0; computing() && e < E; ++e) {
        const int64_t n = off[e + 1] - off[e];
        if (n == 0) continue;
        if (dw1)
          product(Transpose::Yes, Transpose::No, F, C, n, dG, off[e] * F, F, xg, off[e] * C, C,
                  1.0f, dw1->f32() + e * F * C, C);
        if (dw3)
          product(Transpose::Yes, Transpose::No, F, C, n, dU, off[e] * F, F, xg, off[e] * C, C,
                  1.0f, dw3->f32() + e * F * C, C);
      }
    }
    if (gx) {
      Tensor dxg = Tensor::empty(Shape{R, C}, DType::F32, MemoryCategory::Workspace);
      {
        Scope gemms("moe GEMMs dX", Pass::Backward, 2 * gemm_flops(R, C, F));
        if (!computing()) measure_expert(w1v, bf16, false, R, F, C);
        for (int64_t e = 0; computing() && e < E; ++e) {
          const int64_t n = off[e + 1] - off[e];
          if (n == 0) continue;
          expert_input(w1v, e, F, C, n, dG, off[e], 0.0f, dxg.f32() + off[e] * C);
          expert_input(w3v, e, F, C, n, dU, off[e], 1.0f, dxg.f32() + off[e] * C);
        }
      }
      float beta = 0.0f;
      float* dx = gx->get_for_accumulate(&beta).f32();
      if (computing()) {
        const int32_t* pos = group->position.i32();
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < N; ++t) {
          float* d = dx + t * C;
          if (beta == 0.0f) std::fill_n(d, C, 0.0f);
          for (int64_t j = 0; j < k; ++j) {
            const float* row = dxg.f32() + static_cast<int64_t>(pos[t * k + j]) * C;
            for (int64_t c = 0; c < C; ++c) d[c] += row[c];
          }
        }
      }
    }
  });
  return out;
}

Variable row_sigmoid_gated(const Variable& x, const Variable& gate) {
  const Shape& xs = x.shape();
  const int64_t C = xs[xs.ndim() - 1], N = x.value().numel() / C;
  require(gate.value().numel() == N, "row_sigmoid_gated: x (..., C) and gate (..., 1)");
  Scope scope("row sigmoid gate", Pass::Forward);
  Tensor y = new_activation(xs);
  const Tensor xv = fp32_value(x), gv = fp32_value(gate);
  if (computing()) {
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < N; ++t) {
      const float s = 1.0f / (1.0f + std::exp(-gv.f32()[t]));
      for (int64_t c = 0; c < C; ++c) y.f32()[t * C + c] = s * xv.f32()[t * C + c];
    }
  }
  const bool grad = needs_grad({&x, &gate});
  Variable out = Variable::op_output(y, grad);
  if (!grad) return out;
  record_backward("row sigmoid gate",
                  [xv, gv, gx = x.grad_ref(), gg = gate.grad_ref(), gy = out.grad_ref(), N, C] {
                    const Tensor& dyt = gy->tensor();
                    if (!dyt.defined()) return;
                    const Tensor dy = as_f32(dyt);
                    float bx = 0.0f, bg = 0.0f;
                    float* dx = gx ? gx->get_for_accumulate(&bx).f32() : nullptr;
                    float* dg = gg ? gg->get_for_accumulate(&bg).f32() : nullptr;
                    if (!computing()) return;
#pragma omp parallel for schedule(static)
                    for (int64_t t = 0; t < N; ++t) {
                      const float s = 1.0f / (1.0f + std::exp(-gv.f32()[t]));
                      double dot = 0;
                      for (int64_t c = 0; c < C; ++c) {
                        const float d = dy.f32()[t * C + c];
                        dot += static_cast<double>(d) * xv.f32()[t * C + c];
                        if (dx) dx[t * C + c] = bx == 0.0f ? s * d : s * d + dx[t * C + c];
                      }
                      const float grad = static_cast<float>(dot) * s * (1.0f - s);
                      if (dg) dg[t] = bg == 0.0f ? grad : grad + dg[t];
                    }
                  });
  return out;
}

}  // namespace cputrain
