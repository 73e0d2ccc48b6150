#include "engine/core/ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "engine/core/hash.h"
#include "engine/core/op_support.h"
#include "engine/core/profiler.h"
#include "kernels/attention/attention.h"
#include "kernels/cpu/bf16.h"
#include "kernels/gemm/gemm.h"
#include "kernels/ops/bias.h"
#include "kernels/ops/cross_entropy.h"
#include "kernels/ops/embedding.h"
#include "kernels/ops/rmsnorm.h"
#include "kernels/ops/rope.h"
#include "kernels/ops/swiglu.h"
#include "kernels/ops/vector_add.h"

namespace cputrain {
namespace {

using namespace op_support;
using kernels::Transpose;
using profiler::Pass;
using profiler::Scope;

// Shape of x with its last dimension replaced by n.
Shape with_last_dim(const Shape& x, int64_t n) {
  switch (x.ndim()) {
    case 1:
      return Shape{n};
    case 2:
      return Shape{x[0], n};
    case 3:
      return Shape{x[0], x[1], n};
    default:
      return Shape{x[0], x[1], x[2], n};
  }
}

// In bf16 mode, where an op that reads x's FP32 value also saves x for its backward: the tensor
// its pass writes x's rounding into, which x keeps as its bf16 value (what saved(x) returns);
// undefined where there is nothing to write (no backward, a leaf, or x already rounded).
Tensor rounding_in_pass(const Variable& x, bool grad) {
  if (!grad || !x.is_op_output() || x.has_bf16_value()) return Tensor();
  Tensor rounding = new_activation(x.shape(), DType::BF16);
  x.cache_bf16_value(rounding);
  return rounding;
}

uint16_t* bf16_or_null(const Tensor& t) {
  return t.defined() ? t.bf16() : nullptr;
}

// The profiler's names of a layer's three GEMMs.
struct GemmNames {
  const char* y;   // Y = X W^T
  const char* dx;  // dX = dY W
  const char* dw;  // dW += dY^T X
};
constexpr GemmNames kLinearGemms{"linear GEMM Y=XW'", "linear GEMM dX=dY W", "linear GEMM dW=dY'X"};
constexpr GemmNames kLmHeadGemms{"lm_head GEMM Y=XW'", "lm_head GEMM dX=dY W",
                                 "lm_head GEMM dW=dY'X"};

// The same for gemm_bf16_rounded (No, Yes), which goes through an FP32 scratch of M x N where it
// cannot round in its registers (kernels/gemm/gemm.h).
void measure_gemm_rounded(int64_t M, int64_t N, int64_t K) {
  Tensor scratch;
  if (!kernels::gemm_bf16_rounded_direct(K))
    scratch = Tensor::empty(Shape{M, N}, DType::F32, MemoryCategory::Workspace);
  measure_gemm(true, Transpose::No, Transpose::Yes, M, N, K);
}

// out (M, N) = x (M, K) w^T for rows row0 .. row0 + M of x, on the values linear multiplies:
// x's and w's bf16 roundings in bf16 mode, else their FP32 values (xv, wv); w may be quantised.
// `kept`: w^T packed once for the products of several chunks of rows (bf16, not quantised).
void linear_product(const Tensor& xv, int64_t row0, const Tensor& wv, float* out, int64_t M,
                    int64_t N, int64_t K, const GemmNames& names, kernels::KeptB* kept = nullptr) {
  Scope scope(names.y, Pass::Forward, gemm_flops(M, N, K));
  const bool bf16 = xv.dtype() == DType::BF16;
  if (!computing() && dtype_quantized(wv.dtype())) {
    measure_quant_gemm(bf16, true, M, N, K);
  } else if (!computing()) {
    measure_gemm(bf16, Transpose::No, Transpose::Yes, M, N, K);
  } else if (dtype_quantized(wv.dtype()) && bf16) {
    kernels::gemm_quant_forward_bf16(M, xv.bf16() + row0 * K, K, wv.quant(), 0.0f, out, N);
  } else if (dtype_quantized(wv.dtype())) {
    kernels::gemm_quant_forward(M, xv.f32() + row0 * K, K, wv.quant(), 0.0f, out, N);
  } else if (bf16 && kept != nullptr) {
    kernels::gemm_bf16_kept(Transpose::Yes, M, N, K, xv.bf16() + row0 * K, K, wv.bf16(), K, 0.0f,
                            out, N, *kept);
  } else if (bf16) {
    kernels::gemm_bf16(Transpose::No, Transpose::Yes, M, N, K, xv.bf16() + row0 * K, K, wv.bf16(),
                       K, 0.0f, out, N);
  } else {
    kernels::gemm_f32(Transpose::No, Transpose::Yes, M, N, K, xv.f32() + row0 * K, K, wv.f32(), K,
                      0.0f, out, N);
  }
}

// A linear layer's backward from its output gradient dy (M, N), bf16 or FP32 as xv and wv:
// gx (M, K) += dy w and gw (N, K) += dy^T x, each where its gradient is wanted.
void linear_backward_products(const Tensor& dy, const Tensor& xv, const Tensor& wv,
                              const GradRef& gx, const GradRef& gw, int64_t M, int64_t N, int64_t K,
                              const GemmNames& names) {
  // The first contribution to a gradient overwrites it (beta 0) instead of adding to zeros.
  float bx = 1.0f, bw = 1.0f;
  float* dx = gx ? gx->get_for_accumulate(&bx).f32() : nullptr;
  float* dw = gw ? gw->get_for_accumulate(&bw).f32() : nullptr;
  const bool bf16 = dy.dtype() == DType::BF16;
  const bool quantized = wv.defined() && dtype_quantized(wv.dtype());
  require(!quantized || !gw, "linear: a quantised weight takes no gradient");
  if (gx) {
    Scope scope(names.dx, Pass::Backward, gemm_flops(M, K, N));
    if (!computing() && quantized)
      measure_quant_gemm(bf16, false, M, N, K);
    else if (!computing())
      measure_gemm(bf16, Transpose::No, Transpose::No, M, K, N);
    else if (quantized && bf16)
      kernels::gemm_quant_backward_input_bf16(M, dy.bf16(), N, wv.quant(), bx, dx, K);
    else if (quantized)
      kernels::gemm_quant_backward_input(M, dy.f32(), N, wv.quant(), bx, dx, K);
    else if (bf16)
      kernels::gemm_bf16(Transpose::No, Transpose::No, M, K, N, dy.bf16(), N, wv.bf16(), K, bx, dx,
                         K);
    else
      kernels::gemm_f32(Transpose::No, Transpose::No, M, K, N, dy.f32(), N, wv.f32(), K, bx, dx, K);
  }
  if (gw) {
    Scope scope(names.dw, Pass::Backward, gemm_flops(N, K, M));
    if (!computing())
      measure_gemm(bf16, Transpose::Yes, Transpose::No, N, K, M);
    else if (bf16)
      kernels::gemm_bf16(Transpose::Yes, Transpose::No, N, K, M, dy.bf16(), N, xv.bf16(), K, bw, dw,
                         K);
    else
      kernels::gemm_f32(Transpose::Yes, Transpose::No, N, K, M, dy.f32(), N, xv.f32(), K, bw, dw,
                        K);
  }
}

// Adds dy's column sums (M x N, FP32 or bf16) into a bias's gradient, or writes them where it is
// still empty.
void bias_gradient(const GradRef& gb, const Tensor& dy, int64_t M, int64_t N) {
  float beta = 0.0f;
  float* db = gb->get_for_accumulate(&beta).f32();
  if (computing() && dy.dtype() == DType::BF16)
    kernels::bias_backward(db, dy.bf16(), M, N, beta != 0.0f);
  else if (computing())
    kernels::bias_backward(db, dy.f32(), M, N, beta != 0.0f);
}

}  // namespace

namespace {

// y (N, C) = rows tokens[i] of a quantised table (V, C), times scale.
void embedding_quantized(float* y, const int32_t* tokens, const kernels::QuantMatrix& table,
                         int64_t N, float scale) {
  for (int64_t i = 0; i < N; ++i) {
    require(tokens[i] >= 0 && tokens[i] < table.rows, "embedding: a token id outside the table");
    kernels::dequantize_rows(table, tokens[i], 1, y + i * table.cols);
  }
  if (scale != 1.0f) kernels::vector_scale(y, y, scale, N * table.cols);
}

}  // namespace

Tensor attention_input(const Variable& x) {
  return as_f32(saved(x));
}

Variable embedding(const Variable& table, const Tensor& tokens, float scale) {
  require(table.value().ndim() == 2 && tokens.ndim() == 2 && tokens.dtype() == DType::I32,
          "embedding: table (V, C) and tokens (B, T) i32");
  const int64_t C = table.shape()[1];
  const int64_t N = tokens.numel();
  Scope scope("embedding", Pass::Forward);
  Tensor y = new_activation(Shape{tokens.dim(0), tokens.dim(1), C});
  // A frozen table may live as bf16 alone (ParameterSet): widened row by row; or quantised, as
  // its file holds it: each token's row dequantised.
  if (computing() && dtype_quantized(table.value().dtype()))
    embedding_quantized(y.f32(), tokens.i32(), table.value().quant(), N, scale);
  else if (computing() && table.value().dtype() == DType::BF16)
    kernels::embedding_forward_bf16(y.f32(), tokens.i32(), table.value().bf16(), N, C, scale);
  else if (computing())
    kernels::embedding_forward(y.f32(), tokens.i32(), table.value().f32(), N, C, scale);
  const bool grad = needs_grad({&table});
  Variable out = Variable::op_output(y, grad);
  if (grad) {
    record_backward("embedding", [tokens, gt = table.grad_ref(), gy = out.grad_ref(), N, C, scale] {
      if (!gy->tensor().defined()) return;
      const Tensor& gtable = gt->get_or_zeros();
      if (computing())
        kernels::embedding_backward(gtable.f32(), gy->tensor().f32(), tokens.i32(), N, C, scale);
    });
  }
  return out;
}

namespace {

// linear and linear_rounded, with a bias where b is defined; rounded: in bf16 mode the output
// is written as its bf16 rounding alone.
Variable linear_op(const Variable& x, const Variable& w, const Variable& b, bool rounded) {
  const Shape& xs = x.shape();
  require(w.value().ndim() == 2 && xs[xs.ndim() - 1] == w.shape()[1],
          "linear: x (..., K) and w (N, K)");
  const int64_t N = w.shape()[0];
  const int64_t K = w.shape()[1];
  const int64_t M = x.value().numel() / K;
  require(!b.defined() || (b.value().ndim() == 1 && b.shape()[0] == N), "linear: bias (N)");
  Scope scope("linear", Pass::Forward);
  const bool bf16 = bf16_mode();
  rounded = rounded && bf16;
  Tensor y = new_activation(with_last_dim(xs, N), rounded ? DType::BF16 : DType::F32);
  // In bf16 mode both operands are bf16 roundings: x's is shared with the other ops that take
  // x, w's is the parameter's copy.
  const Tensor xv = bf16 ? x.bf16_value() : fp32_value(x);
  const Tensor wv = weight_operand(w, bf16);
  if (rounded && dtype_quantized(wv.dtype())) {  // the FP32 product, then its rounding
    const Tensor sum = Tensor::empty(y.shape(), DType::F32, MemoryCategory::Workspace);
    linear_product(xv, 0, wv, sum.f32(), M, N, K, kLinearGemms);
    if (computing() && b.defined())
      kernels::bias_add_rounded(y.bf16(), sum.f32(), b.value().f32(), M, N);
    else if (computing())
      kernels::fp32_to_bf16_array(y.bf16(), sum.f32(), M * N);
  } else if (rounded && !b.defined()) {
    Scope gemm(kLinearGemms.y, Pass::Forward, gemm_flops(M, N, K));
    if (computing())
      kernels::gemm_bf16_rounded(Transpose::No, Transpose::Yes, M, N, K, xv.bf16(), K, wv.bf16(), K,
                                 y.bf16(), N);
    else
      measure_gemm_rounded(M, N, K);
  } else if (rounded) {  // the sum with the bias is what is rounded
    const Tensor sum = Tensor::empty(y.shape(), DType::F32, MemoryCategory::Workspace);
    linear_product(xv, 0, wv, sum.f32(), M, N, K, kLinearGemms);
    if (computing()) kernels::bias_add_rounded(y.bf16(), sum.f32(), b.value().f32(), M, N);
  } else {
    linear_product(xv, 0, wv, y.f32(), M, N, K, kLinearGemms);
    if (b.defined() && computing()) kernels::bias_add(y.f32(), b.value().f32(), M, N);
  }
  const bool grad = b.defined() ? needs_grad({&x, &w, &b}) : needs_grad({&x, &w});
  Variable out = Variable::op_output(y, grad);
  if (grad) {
    // In bf16 mode the backward takes only the rounding of its output's gradient: an op whose
    // backward is that gradient's only contribution may write the rounding alone.
    if (bf16) out.grad_ref()->set_read_rounded();
    // The gradient of x needs w and that of w needs x: save only what is used.
    Tensor xs_saved = w.requires_grad() ? xv : Tensor();
    Tensor ws_saved = x.requires_grad() ? wv : Tensor();
    const GradRef gb = b.defined() ? b.grad_ref() : GradRef();
    record_backward("linear", [xv = xs_saved, wv = ws_saved, gx = x.grad_ref(), gw = w.grad_ref(),
                               gb, gy = out.grad_ref(), M, N, K, bf16] {
      const Tensor& dy = gy->tensor();
      if (!dy.defined()) return;
      const bool round = bf16 && dy.dtype() != DType::BF16;
      const Tensor dyv = round ? to_bf16(dy) : dy;
      // The bias's gradient from the values the products take: dy's rounding in bf16 mode.
      if (gb) bias_gradient(gb, dyv, M, N);
      linear_backward_products(dyv, xv, wv, gx, gw, M, N, K, kLinearGemms);
    });
  }
  return out;
}

}  // namespace

Variable linear(const Variable& x, const Variable& w, const Variable& b) {
  return linear_op(x, w, b, false);
}

Variable linear_rounded(const Variable& x, const Variable& w, const Variable& b) {
  return linear_op(x, w, b, true);
}

namespace {

constexpr GemmNames kLoraGemms{"lora GEMMs Y+=s(XA')B'", "lora GEMMs dA dB dX", ""};

// C (M x N) = op(A) op(B) + beta C, on bf16 or FP32 operands (both of one type), or the
// allocations it makes while measuring. Row-major, leading dimensions the operands' widths.
void product(Transpose ta, Transpose tb, int64_t M, int64_t N, int64_t K, const Tensor& a,
             const Tensor& b, float beta, float* c) {
  const int64_t lda = ta == Transpose::No ? K : M, ldb = tb == Transpose::No ? N : K;
  if (!computing())
    measure_gemm(a.dtype() == DType::BF16, ta, tb, M, N, K);
  else if (a.dtype() == DType::BF16)
    kernels::gemm_bf16(ta, tb, M, N, K, a.bf16(), lda, b.bf16(), ldb, beta, c, N);
  else
    kernels::gemm_f32(ta, tb, M, N, K, a.f32(), lda, b.f32(), ldb, beta, c, N);
}

// C (M x N) = a op(b) + beta C + u op(v) on bf16 operands, a stored (M, K) and u (M, r): a frozen
// product and a LoRA adapter's rank-r update, as one product where the kernel adds the update to
// each tile of C while it is in cache (kernels::gemm_bf16_low_rank; the same bits as two), or
// the allocations it makes while measuring.
void product_low_rank(Transpose tb, int64_t M, int64_t N, int64_t K, const Tensor& a,
                      const Tensor& b, float beta, float* c, const Tensor& u, const Tensor& v,
                      Transpose tv, int64_t r) {
  if (!computing()) {
    measure_gemm(true, Transpose::No, tb, M, N, K);
    const size_t update = kernels::gemm_low_rank_buffer_bytes(Transpose::No, tb, M, N, K, r);
    if (update > 0)
      measure_buffer(2, update, MemoryCategory::Workspace);
    else
      measure_gemm(true, Transpose::No, tv, M, N, r);
    return;
  }
  const kernels::LowRankUpdate up{u.bf16(), r, v.bf16(), tv == Transpose::Yes ? r : N, tv, r};
  kernels::gemm_bf16_low_rank(Transpose::No, tb, M, N, K, a.bf16(), K, b.bf16(),
                              tb == Transpose::Yes ? K : N, beta, c, N, up);
}

}  // namespace

Variable lora_linear(const Variable& x, const Variable& w, const Variable& b, const Variable& a,
                     const Variable& bm, float scale, float dropout, uint64_t dropout_seed) {
  const Shape& xs = x.shape();
  require(w.value().ndim() == 2 && xs[xs.ndim() - 1] == w.shape()[1],
          "lora_linear: x (..., K) and w (N, K)");
  const int64_t N = w.shape()[0], K = w.shape()[1], M = x.value().numel() / K;
  const int64_t r = a.shape()[0];
  require(a.value().ndim() == 2 && a.shape()[1] == K && bm.value().ndim() == 2 &&
              bm.shape()[0] == N && bm.shape()[1] == r,
          "lora_linear: a (r, K) and b (N, r)");
  require(!b.defined() || (b.value().ndim() == 1 && b.shape()[0] == N), "lora_linear: bias (N)");
  Scope scope("lora_linear", Pass::Forward);
  const bool bf16 = bf16_mode();
  Tensor y = new_activation(with_last_dim(xs, N));
  const Tensor xv = bf16 ? x.bf16_value() : fp32_value(x);
  const Tensor wv = weight_operand(w, bf16);
  const Tensor av = bf16 ? a.bf16_value() : a.value();
  const Tensor bv = bf16 ? bm.bf16_value() : bm.value();
  // u = x A' first, then y = x W' + (s u) B' and the bias: in bf16 over a weight of bf16 values,
  // one product that adds the update to each tile of y while it is in cache (the update's FLOPs
  // counted in the frozen product's scope then); else the update's product accumulates into y.
  const bool one_product = bf16 && wv.dtype() == DType::BF16;
  Tensor su;
  {
    Scope gemm(kLoraGemms.y, Pass::Forward, gemm_flops(M, r, K));
    const Tensor u = Tensor::empty(Shape{M, r}, DType::F32, MemoryCategory::Workspace);
    const Tensor xd = dropout > 0.0f ? dropped_out(xv, dropout, dropout_seed) : xv;
    product(Transpose::No, Transpose::Yes, M, r, K, xd, av, 0.0f, u.f32());
    su = scaled_operand(u, scale, bf16, MemoryCategory::Activations);
  }
  if (one_product) {
    Scope gemm(kLinearGemms.y, Pass::Forward, gemm_flops(M, N, K) + gemm_flops(M, N, r));
    product_low_rank(Transpose::Yes, M, N, K, xv, wv, 0.0f, y.f32(), su, bv, Transpose::Yes, r);
  } else {
    linear_product(xv, 0, wv, y.f32(), M, N, K, kLinearGemms);
    Scope gemm(kLoraGemms.y, Pass::Forward, gemm_flops(M, N, r));
    product(Transpose::No, Transpose::Yes, M, N, r, su, bv, 1.0f, y.f32());
  }
  if (b.defined() && computing()) kernels::bias_add(y.f32(), b.value().f32(), M, N);
  const bool grad = b.defined() ? needs_grad({&x, &w, &b, &a, &bm}) : needs_grad({&x, &w, &a, &bm});
  Variable out = Variable::op_output(y, grad);
  if (grad) {
    if (bf16) out.grad_ref()->set_read_rounded();
    const GradRef gb = b.defined() ? b.grad_ref() : GradRef();
    record_backward("lora_linear", [xv, wv, av, bv, su, gx = x.grad_ref(), gw = w.grad_ref(), gb,
                                    ga = a.grad_ref(), gbm = bm.grad_ref(), gy = out.grad_ref(), M,
                                    N, K, r, scale, bf16, dropout, dropout_seed] {
      const Tensor& dy = gy->tensor();
      if (!dy.defined()) return;
      const Tensor dyv = bf16 && dy.dtype() != DType::BF16 ? to_bf16(dy) : dy;
      if (gb) bias_gradient(gb, dyv, M, N);
      // g = dY B (M x r) first; the update's gradients: dB = dY' (s u), dA = (s g)' X, and
      // dX = dY W + (s g) A, in bf16 without dropout over a weight of bf16 values one product
      // that adds the update to each tile of dX while it is in cache (its FLOPs counted in the
      // base's dX scope then).
      const bool one_product = gx && bf16 && dropout == 0.0f && wv.dtype() == DType::BF16;
      Tensor sg;
      {
        Scope gemm(kLoraGemms.dx, Pass::Backward, gemm_flops(M, r, N));
        const Tensor g = Tensor::empty(Shape{M, r}, DType::F32, MemoryCategory::Workspace);
        product(Transpose::No, Transpose::No, M, r, N, dyv, bv, 0.0f, g.f32());
        sg = scaled_operand(g, scale, bf16, MemoryCategory::Workspace);
      }
      // The base's products: dX = dY W (with the update where one product) and dW where W
      // trains.
      linear_backward_products(dyv, xv, wv, one_product ? GradRef() : gx, gw, M, N, K,
                               kLinearGemms);
      if (one_product) {
        Scope gemm(kLinearGemms.dx, Pass::Backward, gemm_flops(M, K, N) + gemm_flops(M, K, r));
        float beta = 0.0f;
        float* d = gx->get_for_accumulate(&beta).f32();
        product_low_rank(Transpose::No, M, K, N, dyv, wv, beta, d, sg, av, Transpose::No, r);
      }
      Scope gemm(
          kLoraGemms.dx, Pass::Backward,
          gemm_flops(N, r, M) + gemm_flops(r, K, M) + (one_product ? 0 : gemm_flops(M, K, r)));
      if (gbm) {
        // dB (N x r) as its transpose (s u)' dY (r x N): a product of r rows by N columns runs
        // up to 2.6 times as fast as one of N rows by r columns (docs/BENCHMARKS.md). dB goes
        // through t and back where it accumulates, so that the bf16 kernel's bits are those of
        // dY' (s u) into dB (the same pair sums in the same order; GemmPaths tests it).
        float beta = 0.0f;
        float* d = gbm->get_for_accumulate(&beta).f32();
        const Tensor t = Tensor::empty(Shape{r, N}, DType::F32, MemoryCategory::Workspace);
        if (computing() && beta != 0.0f)
          for (int64_t n = 0; n < N; ++n)
            for (int64_t j = 0; j < r; ++j) t.f32()[j * N + n] = d[n * r + j];
        product(Transpose::Yes, Transpose::No, r, N, M, su, dyv, beta, t.f32());
        if (computing())
          for (int64_t n = 0; n < N; ++n)
            for (int64_t j = 0; j < r; ++j) d[n * r + j] = t.f32()[j * N + n];
      }
      if (ga) {
        float beta = 0.0f;
        float* d = ga->get_for_accumulate(&beta).f32();
        // With dropout, the update's input drawn again from the seed.
        const Tensor xd = dropout > 0.0f ? dropped_out(xv, dropout, dropout_seed) : xv;
        product(Transpose::Yes, Transpose::No, r, K, M, sg, xd, beta, d);
      }
      if (gx && dropout > 0.0f) {
        // dX += ((s g) A) masked and scaled as the forward's input was.
        const Tensor t = Tensor::empty(Shape{M, K}, DType::F32, MemoryCategory::Workspace);
        product(Transpose::No, Transpose::No, M, K, r, sg, av, 0.0f, t.f32());
        float beta = 0.0f;
        float* d = gx->get_for_accumulate(&beta).f32();
        if (computing()) {
          const uint32_t threshold = dropout_threshold(dropout);
          const float keep = 1.0f / (1.0f - dropout);
          const int64_t n = M * K;
#pragma omp parallel for schedule(static)
          for (int64_t i = 0; i < n; ++i) {
            const float v = dropout_keeps(dropout_seed, i, threshold) ? t.f32()[i] * keep : 0.0f;
            d[i] = beta != 0.0f ? d[i] + v : v;
          }
        }
      } else if (gx && !one_product) {
        float beta = 0.0f;
        float* d = gx->get_for_accumulate(&beta).f32();
        product(Transpose::No, Transpose::No, M, K, r, sg, av, beta, d);
      }
    });
  }
  return out;
}

namespace {

// rmsnorm over each group of C = w's size of x's last dimension; in bf16 mode with
// `gemm_input` the output is its bf16 rounding alone, else FP32.
Variable rmsnorm_groups(const Variable& x, const Variable& w, float eps, float offset,
                        bool gemm_input) {
  const Shape& xs = x.shape();
  require(w.value().ndim() == 1 && w.shape()[0] > 0 && xs[xs.ndim() - 1] % w.shape()[0] == 0,
          "rmsnorm: x (..., H * C) and w (C)");
  const int64_t C = w.shape()[0];
  const int64_t N = x.value().numel() / C;
  Scope scope("rmsnorm", Pass::Forward);
  const bool grad = needs_grad({&x, &w});
  Tensor y;
  Tensor rstd = new_activation(Shape{N});
  if (bf16_mode() && gemm_input) {
    // The output is only ever a GEMM input: only its bf16 rounding is written, in the pass that
    // also rounds x for the backward.
    y = new_activation(xs, DType::BF16);
    const Tensor x16 = rounding_in_pass(x, grad);
    if (computing())
      kernels::rmsnorm_forward_bf16(y.bf16(), bf16_or_null(x16), rstd.f32(), fp32_value(x).f32(),
                                    w.value().f32(), N, C, eps, offset);
  } else {
    y = new_activation(xs);
    if (computing())
      kernels::rmsnorm_forward(y.f32(), rstd.f32(), fp32_value(x).f32(), w.value().f32(), N, C, eps,
                               offset);
  }
  Variable out = Variable::op_output(y, grad);
  if (grad) {
    record_backward("rmsnorm", [xs = saved(x), wv = w.value(), rstd, gx = x.grad_ref(),
                                gw = w.grad_ref(), gy = out.grad_ref(), N, C, offset] {
      const Tensor& dy = gy->tensor();
      if (!dy.defined()) return;
      // The kernel produces both gradients; a side nobody needs goes to scratch.
      const KernelGrads gxs = kernel_grads({{&gx, Shape{N, C}}});
      const Tensor& dx = gxs.grads[0];
      Tensor dw = summed_gradient(gw, Shape{C});
      if (!computing()) return;
      if (xs.dtype() == DType::BF16)
        kernels::rmsnorm_backward(dx.f32(), dw.f32(), dy.f32(), xs.bf16(), wv.f32(), rstd.f32(), N,
                                  C, gxs.accumulate, offset);
      else
        kernels::rmsnorm_backward(dx.f32(), dw.f32(), dy.f32(), xs.f32(), wv.f32(), rstd.f32(), N,
                                  C, gxs.accumulate, offset);
    });
  }
  return out;
}

}  // namespace

Variable rmsnorm(const Variable& x, const Variable& w, float eps, float offset) {
  require(w.value().ndim() == 1 && w.shape()[0] == x.shape()[x.shape().ndim() - 1],
          "rmsnorm: x (..., C) and w (C)");
  return rmsnorm_groups(x, w, eps, offset, true);
}

Variable head_rmsnorm(const Variable& x, const Variable& w, float eps, float offset) {
  return rmsnorm_groups(x, w, eps, offset, false);
}

SumAndNorm add_rmsnorm(const Variable& a, const Variable& b, const Variable& w, float eps,
                       float offset) {
  const Shape& xs = a.shape();
  require(a.shape() == b.shape(), "add_rmsnorm: a and b of equal shapes");
  require(w.value().ndim() == 1 && w.shape()[0] == xs[xs.ndim() - 1],
          "add_rmsnorm: a, b (..., C) and w (C)");
  const int64_t C = w.shape()[0];
  const int64_t N = a.value().numel() / C;
  Scope scope("add_rmsnorm", Pass::Forward);
  const bool grad = needs_grad({&a, &b, &w});
  Tensor s = new_activation(xs);
  Tensor rstd = new_activation(Shape{N});
  Variable sum = Variable::op_output(s, grad);
  Tensor y;
  if (bf16_mode()) {
    // The norm, as rmsnorm's, only ever a GEMM input: its rounding alone, and the sum's for
    // the backward in the same pass.
    y = new_activation(xs, DType::BF16);
    const Tensor s16 = rounding_in_pass(sum, grad);
    if (computing())
      kernels::add_rmsnorm_forward_bf16(s.f32(), y.bf16(), bf16_or_null(s16), rstd.f32(),
                                        fp32_value(a).f32(), fp32_value(b).f32(), w.value().f32(),
                                        N, C, eps, offset);
  } else {
    y = new_activation(xs);
    if (computing())
      kernels::add_rmsnorm_forward(s.f32(), y.f32(), rstd.f32(), fp32_value(a).f32(),
                                   fp32_value(b).f32(), w.value().f32(), N, C, eps, offset);
  }
  Variable normed = Variable::op_output(y, grad);
  if (grad) {
    record_backward("add_rmsnorm",
                    [ss = saved(sum), wv = w.value(), rstd, ga = a.grad_ref(), gb = b.grad_ref(),
                     gw = w.grad_ref(), gs = sum.grad_ref(), gy = normed.grad_ref(), N, C, offset] {
                      const Tensor& dy = gy->tensor();
                      const Tensor& dsum = gs->tensor();
                      if (!dy.defined()) {
                        // The norm unread: the sum's gradient alone, as add's backward passes it
                        // on.
                        if (!dsum.defined()) return;
                        for (const GradRef* g : {&ga, &gb}) {
                          if (!*g) continue;
                          const Tensor rounded = (*g)->rounded_for_overwrite();
                          if (rounded.defined()) {
                            if (computing())
                              kernels::fp32_to_bf16_array(rounded.bf16(), dsum.f32(), N * C);
                            continue;
                          }
                          float beta = 0.0f;
                          float* d = (*g)->get_for_accumulate(&beta).f32();
                          if (!computing()) continue;
                          if (beta == 0.0f)
                            kernels::vector_copy(d, dsum.f32(), N * C);
                          else
                            kernels::vector_accumulate(d, dsum.f32(), N * C);
                        }
                        return;
                      }
                      // Each side's target, a's first (a and b may be one variable).
                      const auto side = [](const GradRef& g) {
                        kernels::SumGradient out;
                        if (!g) return out;
                        const Tensor rounded = g->rounded_for_overwrite();
                        if (rounded.defined()) {
                          out.rounded = rounded.bf16();
                          return out;
                        }
                        float beta = 0.0f;
                        out.grad = g->get_for_accumulate(&beta).f32();
                        out.accumulate = beta != 0.0f;
                        return out;
                      };
                      const kernels::SumGradient da = side(ga), db = side(gb);
                      Tensor dw = summed_gradient(gw, Shape{C});
                      if (!computing()) return;
                      const float* ds = dsum.defined() ? dsum.f32() : nullptr;
                      if (ss.dtype() == DType::BF16)
                        kernels::add_rmsnorm_backward(da, db, dw.f32(), ds, dy.f32(), ss.bf16(),
                                                      wv.f32(), rstd.f32(), N, C, offset);
                      else
                        kernels::add_rmsnorm_backward(da, db, dw.f32(), ds, dy.f32(), ss.f32(),
                                                      wv.f32(), rstd.f32(), N, C, offset);
                    });
  }
  return {sum, normed};
}

Variable layernorm(const Variable& x, const Variable& w, const Variable& b, float eps) {
  const Shape& xs = x.shape();
  const int64_t C = xs[xs.ndim() - 1];
  require(w.value().ndim() == 1 && w.shape()[0] == C && b.defined() && b.value().ndim() == 1 &&
              b.shape()[0] == C,
          "layernorm: x (..., C), w (C) and b (C)");
  const int64_t N = x.value().numel() / C;
  Scope scope("layernorm", Pass::Forward);
  const bool grad = needs_grad({&x, &w, &b});
  Tensor mean = new_activation(Shape{N}), rstd = new_activation(Shape{N});
  Tensor y;
  if (bf16_mode()) {
    // As rmsnorm's: only ever a GEMM input, written as its bf16 rounding alone.
    y = new_activation(xs, DType::BF16);
    const Tensor x16 = rounding_in_pass(x, grad);
    if (computing())
      kernels::layernorm_forward_bf16(y.bf16(), bf16_or_null(x16), mean.f32(), rstd.f32(),
                                      fp32_value(x).f32(), w.value().f32(), b.value().f32(), N, C,
                                      eps);
  } else {
    y = new_activation(xs);
    if (computing())
      kernels::layernorm_forward(y.f32(), mean.f32(), rstd.f32(), fp32_value(x).f32(),
                                 w.value().f32(), b.value().f32(), N, C, eps);
  }
  Variable out = Variable::op_output(y, grad);
  if (grad) {
    record_backward("layernorm", [xs = saved(x), wv = w.value(), mean, rstd, gx = x.grad_ref(),
                                  gw = w.grad_ref(), gb = b.grad_ref(), gy = out.grad_ref(), N, C] {
      const Tensor& dy = gy->tensor();
      if (!dy.defined()) return;
      const KernelGrads gxs = kernel_grads({{&gx, Shape{N, C}}});
      const Tensor& dx = gxs.grads[0];
      Tensor dw = summed_gradient(gw, Shape{C}), db = summed_gradient(gb, Shape{C});
      if (!computing()) return;
      if (xs.dtype() == DType::BF16)
        kernels::layernorm_backward(dx.f32(), dw.f32(), db.f32(), dy.f32(), xs.bf16(), wv.f32(),
                                    mean.f32(), rstd.f32(), N, C, gxs.accumulate);
      else
        kernels::layernorm_backward(dx.f32(), dw.f32(), db.f32(), dy.f32(), xs.f32(), wv.f32(),
                                    mean.f32(), rstd.f32(), N, C, gxs.accumulate);
    });
  }
  return out;
}

Variable rope(const Variable& x, const Tensor& table, int64_t n_heads, bool half_split,
              bool per_row, int64_t rot_dims) {
  const Shape& xs = x.shape();
  require(xs.ndim() == 3 && xs[2] % n_heads == 0 && (xs[2] / n_heads) % 2 == 0,
          "rope: x (B, T, C) with C = H * D, D even");
  const int64_t B = xs[0], T = xs[1], H = n_heads, D = xs[2] / n_heads;
  const int64_t R = rot_dims > 0 ? rot_dims : D;
  require(R <= D && R % 2 == 0, "rope: rotated dimensions even and at most D");
  require(table.numel() >= (per_row ? B : 1) * T * R, "rope: table shorter than T");
  // Each row with its own table, or all with the one.
  const int64_t rows = per_row ? B : 1, each = per_row ? 1 : B, stride = T * H * D;
  Scope scope("rope", Pass::Forward);
  const bool grad = needs_grad({&x});
  // In bf16 mode attention takes only the bf16 rounding of q and k: only that is written.
  Tensor y = new_activation(xs, bf16_mode() ? DType::BF16 : DType::F32);
  for (int64_t r = 0; r < rows && computing(); ++r) {
    const float* t = table.f32() + r * T * R;
    if (y.dtype() == DType::BF16)
      kernels::rope_forward_bf16(y.bf16() + r * stride, fp32_value(x).f32() + r * stride, t, each,
                                 T, H, D, half_split, R);
    else
      kernels::rope_forward(y.f32() + r * stride, fp32_value(x).f32() + r * stride, t, each, T, H,
                            D, half_split, R);
  }
  Variable out = Variable::op_output(y, grad);
  if (grad) {
    record_backward("rope", [table, gx = x.grad_ref(), gy = out.grad_ref(), rows, each, stride, T,
                             H, D, R, half_split] {
      if (!gy->tensor().defined()) return;
      const float* dy = gy->tensor().f32();
      if (gx) {  // x's gradient written as its rounding, where that is all x's producer reads
        const Tensor rounded = gx->rounded_for_overwrite();
        if (rounded.defined()) {
          for (int64_t r = 0; r < rows && computing(); ++r)
            kernels::rope_backward_bf16(rounded.bf16() + r * stride, dy + r * stride,
                                        table.f32() + r * T * R, each, T, H, D, half_split, R);
          return;
        }
      }
      const KernelGrads g = kernel_grads({{&gx, Shape{rows * each, T, H * D}}});
      for (int64_t r = 0; r < rows && computing(); ++r)
        kernels::rope_backward(g.grads[0].f32() + r * stride, dy + r * stride,
                               table.f32() + r * T * R, each, T, H, D, half_split, g.accumulate, R);
    });
  }
  return out;
}

namespace {

// The sequences attention runs on, one kernel call each: all B rows at once, or with packing
// each sequence of each row as a batch of one. `lse` is where its statistics begin in the op's
// (B, H, T) buffer, each sequence's (H, its length) in turn.
struct AttentionPart {
  int64_t row_offset;  // positions from the start of the batch
  int64_t B, T;
  int64_t lse_offset;
};

std::vector<AttentionPart> attention_parts(int64_t B, int64_t T, int64_t H,
                                           const Packing* packing) {
  if (!packing) return {{0, B, T, 0}};
  require(static_cast<int64_t>(packing->lengths.size()) == B, "attention: packing of B rows");
  std::vector<AttentionPart> parts;
  int64_t lse = 0;
  for (int64_t b = 0; b < B; ++b) {
    int64_t start = 0;
    for (const int64_t n : packing->lengths[static_cast<size_t>(b)]) {
      require(n > 0, "attention: packed sequences of at least one position");
      parts.push_back({b * T + start, 1, n, lse});
      start += n;
      lse += H * n;
    }
    require(start == T, "attention: packed lengths summing to T");
  }
  return parts;
}

}  // namespace

Variable attention(const Variable& q, const Variable& k, const Variable& v, int64_t n_heads,
                   int64_t n_kv_heads, std::shared_ptr<const Packing> packing,
                   kernels::AttentionOptions options, const Variable& sinks) {
  const Shape& s = q.shape();
  const Shape& kvs = k.shape();
  require(n_heads > 0 && n_kv_heads > 0 && n_heads % n_kv_heads == 0 && s.ndim() == 3 &&
              s[2] % n_heads == 0,
          "attention: q (B, T, H * D), H a multiple of the key/value heads");
  const int64_t B = s[0], T = s[1], H = n_heads, KVH = n_kv_heads, D = s[2] / n_heads;
  require(kvs == Shape{B, T, KVH * D} && v.shape() == kvs, "attention: k, v (B, T, KVH * D)");
  // A window no shorter than the sequence is none.
  if (options.window >= T) options.window = 0;
  require(!sinks.defined() || sinks.value().numel() == H, "attention: sinks (H)");
  const Tensor sv = sinks.defined() ? fp32_value(sinks) : Tensor();
  if (sv.defined()) options.sinks = sv.f32();
  const std::vector<AttentionPart> parts = attention_parts(B, T, H, packing.get());
  // Causal: query t meets t + 1 keys (at most the window); each product is 2 D FLOPs per
  // (query, key) pair.
  double pair_flops = 0.0;
  for (const AttentionPart& p : parts) {
    double pairs = static_cast<double>(p.T) * static_cast<double>(p.T + 1) / 2.0;
    if (options.window > 0 && p.T > options.window) {
      const auto w = static_cast<double>(options.window), t = static_cast<double>(p.T);
      pairs = w * (w + 1.0) / 2.0 + (t - w) * w;
    }
    pair_flops += 2.0 * static_cast<double>(p.B * H * D) * pairs;
  }
  Scope scope("attention", Pass::Forward, 2.0 * pair_flops);  // S = Q K^T, O = P V
  Tensor lse = new_activation(Shape{B, H, T});
  // In bf16 mode attention runs on the bf16 roundings of q, k and v, the tensors its backward
  // will see, with bf16 products where the CPU has them (else widened to FP32); the softmax
  // statistics stay FP32. With bf16 products it writes only the bf16 rounding of its output:
  // all the output projection and the backward take of it.
  const Tensor qs = saved(q), ks = saved(k), vs = saved(v);
  const bool native = qs.dtype() == DType::BF16 && kernels::attention_bf16_native();
  Tensor y = new_activation(s, native ? DType::BF16 : DType::F32);
  const int64_t QD = H * D, KD = KVH * D;
  if (native) {
    for (const AttentionPart& p : parts)
      if (computing())
        kernels::attention_forward_bf16(
            y.bf16() + p.row_offset * QD, lse.f32() + p.lse_offset, qs.bf16() + p.row_offset * QD,
            ks.bf16() + p.row_offset * KD, vs.bf16() + p.row_offset * KD, p.B, p.T, H, KVH, D,
            options);
  } else {
    const Tensor qf = as_f32(qs), kf = as_f32(ks), vf = as_f32(vs);
    for (const AttentionPart& p : parts)
      if (computing())
        kernels::attention_forward(y.f32() + p.row_offset * QD, lse.f32() + p.lse_offset,
                                   qf.f32() + p.row_offset * QD, kf.f32() + p.row_offset * KD,
                                   vf.f32() + p.row_offset * KD, p.B, p.T, H, KVH, D, options);
  }
  const bool grad = needs_grad({&q, &k, &v, &sinks});
  Variable out = Variable::op_output(y, grad);
  if (grad) {
    record_backward("attention", [qs, ks, vs, ys = saved(out), lse, sv, gq = q.grad_ref(),
                                  gk = k.grad_ref(), gv = v.grad_ref(), gs = sinks.grad_ref(),
                                  gy = out.grad_ref(), native, pair_flops, parts, B, T, H, KVH, D,
                                  QD, KD, options] {
      const Tensor& dy = gy->tensor();
      if (!dy.defined()) return;
      if (gs) {
        // The sinks': -sum over each head's rows of exp(sink - lse) (dout . out).
        float beta = 0.0f;
        float* ds = gs->get_for_accumulate(&beta).f32();
        if (computing()) {
          const Tensor yf = as_f32(ys);
          std::vector<double> sum(static_cast<size_t>(H), 0.0);
          for (const AttentionPart& p : parts)
            for (int64_t b = 0; b < p.B; ++b)
              for (int64_t h = 0; h < H; ++h)
                for (int64_t i = 0; i < p.T; ++i) {
                  const int64_t row = (p.row_offset + b * p.T + i) * QD + h * D;
                  double dot = 0.0;
                  for (int64_t d = 0; d < D; ++d)
                    dot += static_cast<double>(dy.f32()[row + d]) * yf.f32()[row + d];
                  const float l = lse.f32()[p.lse_offset + (b * H + h) * p.T + i];
                  sum[static_cast<size_t>(h)] -=
                      std::exp(static_cast<double>(sv.f32()[h] - l)) * dot;
                }
          for (int64_t h = 0; h < H; ++h)
            ds[h] = static_cast<float>(sum[static_cast<size_t>(h)]) + (beta == 0.0f ? 0.0f : ds[h]);
        }
      }
      if (!gq && !gk && !gv) return;
      // S again, dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q.
      profiler::add_flops(5.0 * pair_flops);
      const Shape kv_shape{B, T, KVH * D};
      const KernelGrads g =
          kernel_grads({{&gq, Shape{B, T, H * D}}, {&gk, kv_shape}, {&gv, kv_shape}});
      const Tensor &dq = g.grads[0], &dk = g.grads[1], &dv = g.grads[2];
      if (native) {
        if (!computing()) return;
        for (const AttentionPart& p : parts)
          kernels::attention_backward_bf16(
              dq.f32() + p.row_offset * QD, dk.f32() + p.row_offset * KD,
              dv.f32() + p.row_offset * KD, dy.f32() + p.row_offset * QD,
              qs.bf16() + p.row_offset * QD, ks.bf16() + p.row_offset * KD,
              vs.bf16() + p.row_offset * KD, ys.bf16() + p.row_offset * QD,
              lse.f32() + p.lse_offset, p.B, p.T, H, KVH, D, g.accumulate, options);
        return;
      }
      const Tensor qv = as_f32(qs), kv = as_f32(ks), vv = as_f32(vs), yv = as_f32(ys);
      for (const AttentionPart& p : parts)
        if (computing())
          kernels::attention_backward(dq.f32() + p.row_offset * QD, dk.f32() + p.row_offset * KD,
                                      dv.f32() + p.row_offset * KD, dy.f32() + p.row_offset * QD,
                                      qv.f32() + p.row_offset * QD, kv.f32() + p.row_offset * KD,
                                      vv.f32() + p.row_offset * KD, yv.f32() + p.row_offset * QD,
                                      lse.f32() + p.lse_offset, p.B, p.T, H, KVH, D, g.accumulate,
                                      options);
    });
  }
  return out;
}

namespace {

// act(gate) * up, or act(gate) alone where up is undefined (swiglu, geglu, gelu).
Variable gated_activation(const Variable& gate, const Variable& up, kernels::Activation act,
                          const char* name) {
  require(!up.defined() || gate.shape() == up.shape(),
          "gated activation: gate and up of equal shape");
  const int64_t n = gate.value().numel();
  Scope scope(name, Pass::Forward);
  const bool grad = up.defined() ? needs_grad({&gate, &up}) : needs_grad({&gate});
  const auto up_f32 = [&up]() { return up.defined() ? fp32_value(up).f32() : nullptr; };
  Tensor y;
  if (bf16_mode()) {
    // The output is only ever a GEMM input (the down projection's), which takes its bf16
    // rounding: only that is written, in the pass that also rounds gate and up for the backward.
    y = new_activation(gate.shape(), DType::BF16);
    const Tensor gate16 = rounding_in_pass(gate, grad);
    const Tensor up16 = up.defined() ? rounding_in_pass(up, grad) : Tensor();
    if (computing())
      kernels::swiglu_forward_bf16(y.bf16(), bf16_or_null(gate16), bf16_or_null(up16),
                                   fp32_value(gate).f32(), up_f32(), n, act);
  } else {
    y = new_activation(gate.shape());
    if (computing()) kernels::swiglu_forward(y.f32(), fp32_value(gate).f32(), up_f32(), n, act);
  }
  Variable out = Variable::op_output(y, grad);
  if (grad) {
    const bool gated = up.defined();
    record_backward(
        name, [gs = saved(gate), us = gated ? saved(up) : Tensor(), gg = gate.grad_ref(),
               gu = gated ? up.grad_ref() : GradRef(), gy = out.grad_ref(), n, act, gated] {
          const Tensor& dy = gy->tensor();
          if (!dy.defined()) return;
          const auto bf16_of = [](const Tensor& t) { return t.defined() ? t.bf16() : nullptr; };
          const auto f32_of = [](const Tensor& t) { return t.defined() ? t.f32() : nullptr; };
          // Both gradients written as their roundings, where that is all gate's and up's producers
          // read (linear layers in bf16 mode) and this is their only contribution.
          if (gg && (gu || !gated) && gs.dtype() == DType::BF16 && gg->rounded_ok() &&
              (!gated || gu->rounded_ok())) {
            const Tensor dg16 = gg->rounded_for_overwrite();
            const Tensor du16 = gated ? gu->rounded_for_overwrite() : Tensor();
            if (!computing()) return;
            return kernels::swiglu_backward_rounded(dg16.bf16(), bf16_of(du16), dy.f32(), gs.bf16(),
                                                    bf16_of(us), n, act);
          }
          const KernelGrads g = gated ? kernel_grads({{&gg, Shape{n}}, {&gu, Shape{n}}})
                                      : kernel_grads({{&gg, Shape{n}}});
          const Tensor& dg = g.grads[0];
          const Tensor du = gated ? g.grads[1] : Tensor();
          if (!computing()) return;
          if (gs.dtype() == DType::BF16)
            kernels::swiglu_backward(dg.f32(), f32_of(du), dy.f32(), gs.bf16(), bf16_of(us), n,
                                     g.accumulate, act);
          else
            kernels::swiglu_backward(dg.f32(), f32_of(du), dy.f32(), gs.f32(), f32_of(us), n,
                                     g.accumulate, act);
        });
  }
  return out;
}

}  // namespace

Variable swiglu(const Variable& gate, const Variable& up) {
  require(up.defined(), "swiglu: gate and up");
  return gated_activation(gate, up, kernels::Activation::Silu, "swiglu");
}

Variable geglu(const Variable& gate, const Variable& up) {
  require(up.defined(), "geglu: gate and up");
  return gated_activation(gate, up, kernels::Activation::GeluTanh, "geglu");
}

Variable gelu(const Variable& x) {
  return gated_activation(x, Variable(), kernels::Activation::GeluTanh, "gelu");
}

Variable add(const Variable& a, const Variable& b) {
  require(a.shape() == b.shape(), "add: equal shapes");
  const int64_t n = a.value().numel();
  Scope scope("add", Pass::Forward);
  Tensor y = new_activation(a.shape());
  if (computing()) kernels::vector_add(y.f32(), fp32_value(a).f32(), fp32_value(b).f32(), n);
  const bool grad = needs_grad({&a, &b});
  Variable out = Variable::op_output(y, grad);
  if (grad) {
    record_backward("add", [ga = a.grad_ref(), gb = b.grad_ref(), gy = out.grad_ref(), n] {
      const Tensor& dy = gy->tensor();
      if (!dy.defined()) return;
      // One side after the other (a and b may be the same): the first contribution is a copy,
      // or its rounding where that is all the side's producer reads.
      for (const GradRef* g : {&ga, &gb}) {
        if (!*g) continue;
        const Tensor rounded = (*g)->rounded_for_overwrite();
        if (rounded.defined()) {
          if (computing()) kernels::fp32_to_bf16_array(rounded.bf16(), dy.f32(), n);
          continue;
        }
        float beta = 0.0f;
        float* d = (*g)->get_for_accumulate(&beta).f32();
        if (!computing()) continue;
        if (beta == 0.0f)
          kernels::vector_copy(d, dy.f32(), n);
        else
          kernels::vector_accumulate(d, dy.f32(), n);
      }
    });
  }
  return out;
}

namespace {

// Adds dy (n FP32 values) times `s` into gradient `g`, the first contribution overwriting.
void add_scaled_gradient(const GradRef& g, const float* dy, int64_t n, float s) {
  if (!g) return;
  float beta = 0.0f;
  float* d = g->get_for_accumulate(&beta).f32();
  if (!computing()) return;
  if (beta == 0.0f) {
    kernels::vector_scale(d, dy, s, n);
  } else {
    for (int64_t i = 0; i < n; ++i) d[i] += dy[i] * s;
  }
}

// x's values times s, an op's output.
Tensor scaled_value(const Variable& x, float s) {
  Tensor y = new_activation(x.shape());
  if (computing()) kernels::vector_scale(y.f32(), fp32_value(x).f32(), s, x.value().numel());
  return y;
}

}  // namespace

Variable scale(const Variable& x, float s) {
  const int64_t n = x.value().numel();
  Scope scope("scale", Pass::Forward);
  Tensor y = scaled_value(x, s);
  const bool grad = needs_grad({&x});
  Variable out = Variable::op_output(y, grad);
  if (grad) {
    record_backward("scale", [gx = x.grad_ref(), gy = out.grad_ref(), n, s] {
      const Tensor& dy = gy->tensor();
      if (!dy.defined()) return;
      add_scaled_gradient(gx, computing() ? dy.f32() : nullptr, n, s);
    });
  }
  return out;
}

Variable scale_by(const Variable& x, const Variable& w) {
  require(w.value().numel() == 1, "scale_by: w of one element");
  const int64_t n = x.value().numel();
  Scope scope("scale_by", Pass::Forward);
  Tensor y = scaled_value(x, computing() ? w.value().f32()[0] : 0.0f);
  const bool grad = needs_grad({&x, &w});
  Variable out = Variable::op_output(y, grad);
  if (grad) {
    // x's values for w's gradient, where it takes one.
    const Tensor xv = w.requires_grad() ? fp32_value(x) : Tensor();
    record_backward("scale_by", [gx = x.grad_ref(), gw = w.grad_ref(), gy = out.grad_ref(), xv,
                                 wv = w.value(), n] {
      const Tensor& dy = gy->tensor();
      if (!dy.defined()) return;
      const float s = computing() ? wv.f32()[0] : 0.0f;
      add_scaled_gradient(gx, computing() ? dy.f32() : nullptr, n, s);
      if (!gw) return;
      double sum = 0.0;
      if (computing())
        for (int64_t i = 0; i < n; ++i)
          sum += static_cast<double>(dy.f32()[i]) * static_cast<double>(xv.f32()[i]);
      const float dw = static_cast<float>(sum);
      add_scaled_gradient(gw, &dw, 1, 1.0f);
    });
  }
  return out;
}

Variable column_slice(const Variable& x, int64_t start, int64_t width) {
  const Shape& xs = x.shape();
  const int64_t K = xs[xs.ndim() - 1];
  require(start >= 0 && width > 0 && start + width <= K, "column_slice: columns within x's");
  const int64_t rows = x.value().numel() / K;
  const Shape ys = xs.ndim() == 3 ? Shape{xs[0], xs[1], width} : Shape{rows, width};
  Scope scope("column_slice", Pass::Forward);
  Tensor y = new_activation(ys);
  if (computing()) {
    const float* a = fp32_value(x).f32();
    for (int64_t r = 0; r < rows; ++r) std::copy_n(a + r * K + start, width, y.f32() + r * width);
  }
  const bool grad = needs_grad({&x});
  Variable out = Variable::op_output(y, grad);
  if (grad) {
    record_backward("column_slice",
                    [gx = x.grad_ref(), gy = out.grad_ref(), rows, K, start, width] {
                      const Tensor& dy = gy->tensor();
                      if (!dy.defined()) return;
                      float beta = 0.0f;
                      float* d = gx->get_for_accumulate(&beta).f32();
                      if (!computing()) return;
                      for (int64_t r = 0; r < rows; ++r) {
                        float* row = d + r * K;
                        const float* g = dy.f32() + r * width;
                        if (beta == 0.0f) {
                          std::fill_n(row, K, 0.0f);
                          std::copy_n(g, width, row + start);
                        } else {
                          for (int64_t c = 0; c < width; ++c) row[start + c] += g[c];
                        }
                      }
                    });
  }
  return out;
}

Variable gather_rows(const Variable& x, std::vector<int64_t> rows) {
  const Shape& xs = x.shape();
  const int64_t K = xs[xs.ndim() - 1], N = x.value().numel() / K;
  const auto n = static_cast<int64_t>(rows.size());
  Scope scope("gather rows", Pass::Forward);
  const Tensor& xv = x.value();
  const size_t bytes = dtype_bytes(xv.dtype(), K);
  Tensor y = new_activation(Shape{n, K}, xv.dtype());
  if (computing()) {
    for (int64_t i = 0; i < n; ++i)
      require(rows[static_cast<size_t>(i)] >= 0 && rows[static_cast<size_t>(i)] < N &&
                  (i == 0 || rows[static_cast<size_t>(i)] > rows[static_cast<size_t>(i - 1)]),
              "gather_rows: ascending rows of x");
    const auto* from = static_cast<const char*>(xv.raw());
    auto* to = static_cast<char*>(y.raw());
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i)
      std::memcpy(to + static_cast<size_t>(i) * bytes,
                  from + static_cast<size_t>(rows[static_cast<size_t>(i)]) * bytes, bytes);
  }
  const bool grad = needs_grad({&x});
  Variable out = Variable::op_output(y, grad);
  if (grad) {
    record_backward("gather rows",
                    [gx = x.grad_ref(), gy = out.grad_ref(), rows = std::move(rows), N, K] {
                      const Tensor& dy = gy->tensor();
                      if (!dy.defined()) return;
                      float beta = 0.0f;
                      float* dx = gx->get_for_accumulate(&beta).f32();
                      if (!computing()) return;
        // Row r of x takes the gradient of the gathered row before it; rows between take zeros.
#pragma omp parallel for schedule(static)
                      for (int64_t r = 0; r < N; ++r) {
                        const auto at = std::lower_bound(rows.begin(), rows.end(), r);
                        const bool taken = at != rows.end() && *at == r;
                        float* d = dx + r * K;
                        if (taken) {
                          const float* g = dy.f32() + (at - rows.begin()) * K;
                          if (beta == 0.0f)
                            std::copy_n(g, K, d);
                          else
                            kernels::vector_accumulate(d, g, K);
                        } else if (beta == 0.0f) {
                          std::fill_n(d, K, 0.0f);
                        }
                      }
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
  Scope scope("cross_entropy", Pass::Forward);
  Tensor losses = Tensor::empty(Shape{N}, DType::F32, MemoryCategory::Workspace);
  Tensor lse = new_activation(Shape{N});
  Tensor y = new_activation(Shape{1});
  if (computing()) {
    kernels::cross_entropy_forward(losses.f32(), lse.f32(), fp32_value(logits).f32(), targets.i32(),
                                   N, V);
    double sum = 0.0;
    for (int64_t i = 0; i < N; ++i) sum += losses.f32()[i];
    y.f32()[0] = static_cast<float>(sum / static_cast<double>(N));
  }
  const bool grad = needs_grad({&logits});
  Variable out = Variable::op_output(y, grad);
  if (grad) {
    record_backward("cross_entropy", [lv = logits.value(), lse, targets, gl = logits.grad_ref(),
                                      gy = out.grad_ref(), N, V] {
      const Tensor& dy = gy->tensor();
      if (!dy.defined()) return;
      Tensor dlosses = Tensor::empty(Shape{N}, DType::F32, MemoryCategory::Workspace);
      const Tensor& dlogits = gl->get_or_zeros();
      if (!computing()) return;
      const float each = dy.f32()[0] / static_cast<float>(N);
      for (int64_t i = 0; i < N; ++i) dlosses.f32()[i] = each;
      kernels::cross_entropy_backward(dlogits.f32(), lv.f32(), lse.f32(), targets.i32(),
                                      dlosses.f32(), N, V);
    });
  }
  return out;
}

int64_t lm_head_chunk_rows(int64_t V, bool kept) {
  return std::max<int64_t>(kept ? 256 : 512, (int64_t{32} << 20) / (4 * std::max<int64_t>(V, 1)));
}

namespace {

// lm_head_cross_entropy, and with `per_row` lm_head_log_probs: the same logits, losses and
// gradient by the logits, which per_row keeps for an output gradient of 1 a row.
Variable lm_head_loss(const Variable& x, const Variable& w, const Tensor& targets,
                      int64_t chunk_rows, int64_t normalizer, const Variable& b, float softcap,
                      bool per_row) {
  const Shape& xs = x.shape();
  require(w.value().ndim() == 2 && xs[xs.ndim() - 1] == w.shape()[1],
          "lm_head_cross_entropy: x (..., K) and w (V, K)");
  const int64_t V = w.shape()[0], K = w.shape()[1];
  require(!b.defined() || (b.value().ndim() == 1 && b.shape()[0] == V),
          "lm_head_cross_entropy: bias (V)");
  const int64_t N = x.value().numel() / K;
  require(targets.dtype() == DType::I32 && targets.numel() == N,
          "lm_head_cross_entropy: one i32 target per row of x");
  Scope scope("lm_head + cross_entropy", Pass::Forward);
  const bool bf16 = bf16_mode();
  const Tensor xv = bf16 ? x.bf16_value() : fp32_value(x);
  const Tensor wv = weight_operand(w, bf16);
  // W^T packed once for every chunk's product where the GEMM keeps it, instead of once a chunk.
  const size_t kept_bytes =
      bf16 && !dtype_quantized(wv.dtype()) ? kernels::gemm_bf16_kept_b_bytes(V, K) : 0;
  const int64_t rows =
      std::min(N, chunk_rows > 0 ? chunk_rows : lm_head_chunk_rows(V, kept_bytes > 0));
  Tensor kept_w;
  kernels::KeptB kept{nullptr};
  if (kept_bytes > 0 && rows < N && kernels::gemm_bf16_keeps_b(Transpose::Yes, rows, V, K)) {
    kept_w = Tensor::empty(Shape{static_cast<int64_t>(kept_bytes / sizeof(float))}, DType::F32,
                           MemoryCategory::Workspace);
    kept.data = kept_w.f32();
  }
  const bool grad = b.defined() ? needs_grad({&x, &w, &b}) : needs_grad({&x, &w});
  // The gradient by the logits, (N, V): also where fp32 mode computes each chunk's logits.
  Tensor dl;
  if (grad)
    dl = Tensor::empty(Shape{N, V}, bf16 ? DType::BF16 : DType::F32, MemoryCategory::Activations);
  // Soft-capped logits keep cap * tanh(z / cap) in `chunk` and the FP32 gradient by them in
  // `capped_grad`, which the chain rule's 1 - tanh^2 turns into the gradient by z.
  const bool capped = softcap > 0.0f;
  Tensor chunk, capped_grad;
  if (!grad || bf16 || capped)
    chunk = Tensor::empty(Shape{rows, V}, DType::F32, MemoryCategory::Workspace);
  if (grad && capped)
    capped_grad = Tensor::empty(Shape{rows, V}, DType::F32, MemoryCategory::Workspace);
  Tensor losses = Tensor::empty(Shape{N}, DType::F32, MemoryCategory::Workspace);
  Tensor lse;
  if (!grad) lse = Tensor::empty(Shape{rows}, DType::F32, MemoryCategory::Workspace);
  // Rows without a target (below 0) are computed as if their target were 0, then given no loss
  // and no gradient.
  const int32_t* tg = targets.i32();
  int64_t counted = 0;
  if (computing())
    for (int64_t i = 0; i < N; ++i) counted += tg[i] >= 0;
  const bool ignoring = computing() && counted < N;
  std::vector<int32_t> clamped;
  if (ignoring) {
    clamped.assign(tg, tg + N);
    for (int32_t& t : clamped) t = std::max(t, 0);
    tg = clamped.data();
  }
  const int64_t divisor = normalizer > 0 ? normalizer : std::max<int64_t>(counted, 1);
  const float each = per_row ? 1.0f : 1.0f / static_cast<float>(computing() ? divisor : N);
  for (int64_t r0 = 0; r0 < N; r0 += rows) {
    const int64_t m = std::min(rows, N - r0);
    float* logits = chunk.defined() ? chunk.f32() : dl.f32() + r0 * V;
    linear_product(xv, r0, wv, logits, m, V, K, kLmHeadGemms, kept_w.defined() ? &kept : nullptr);
    if (b.defined() && computing()) kernels::bias_add(logits, b.value().f32(), m, V);
    if (capped && computing()) kernels::logit_soft_cap(logits, m * V, softcap);
    Scope ce("cross_entropy", Pass::Forward);
    if (!computing()) {
      continue;
    } else if (capped && grad) {
      kernels::cross_entropy_forward_gradient(capped_grad.f32(), losses.f32() + r0, logits, tg + r0,
                                              each, m, V);
      kernels::logit_soft_cap_gradient(capped_grad.f32(), logits, m * V, softcap);
      if (bf16)
        kernels::fp32_to_bf16_array(dl.bf16() + r0 * V, capped_grad.f32(), m * V);
      else
        std::copy_n(capped_grad.f32(), m * V, dl.f32() + r0 * V);
    } else if (!grad) {
      kernels::cross_entropy_forward(losses.f32() + r0, lse.f32(), logits, tg + r0, m, V);
    } else if (bf16) {  // the gradient's rounding straight from each row (the chunk overwritten)
      kernels::cross_entropy_forward_gradient_bf16(dl.bf16() + r0 * V, losses.f32() + r0, logits,
                                                   tg + r0, each, m, V);
    } else {
      kernels::cross_entropy_forward_gradient(logits, losses.f32() + r0, logits, tg + r0, each, m,
                                              V);
    }
    if (!ignoring) continue;
    for (int64_t i = r0; i < r0 + m; ++i) {
      if (targets.i32()[i] >= 0) continue;
      losses.f32()[i] = 0.0f;
      if (!grad) continue;
      if (bf16)
        std::fill_n(dl.bf16() + i * V, V, uint16_t{0});
      else
        std::fill_n(dl.f32() + i * V, V, 0.0f);
    }
  }
  Tensor y = new_activation(Shape{per_row ? N : 1});
  if (computing() && per_row) {
    for (int64_t i = 0; i < N; ++i) y.f32()[i] = -losses.f32()[i];
  } else if (computing()) {
    double sum = 0.0;
    for (int64_t i = 0; i < N; ++i) sum += losses.f32()[i];
    y.f32()[0] = static_cast<float>(sum / static_cast<double>(divisor));
  }
  Variable out = Variable::op_output(y, grad);
  if (grad) {
    Tensor xs_saved = w.requires_grad() ? xv : Tensor();
    Tensor ws_saved = x.requires_grad() ? wv : Tensor();
    auto backward = [dl, xv = xs_saved, wv = ws_saved, gx = x.grad_ref(), gw = w.grad_ref(),
                     gb = b.defined() ? b.grad_ref() : GradRef(), gy = out.grad_ref(), N, V, K,
                     bf16, per_row] {
      const Tensor& dy = gy->tensor();
      if (!dy.defined()) return;
      if (per_row && computing()) {
        // Row i's gradient by the logits is that of its loss, the log-probability's negative.
        const float* g = dy.f32();
        if (bf16) {
          uint16_t* d = dl.bf16();
#pragma omp parallel for schedule(static)
          for (int64_t i = 0; i < N; ++i)
            for (int64_t j = 0; j < V; ++j)
              d[i * V + j] = kernels::fp32_to_bf16(-g[i] * kernels::bf16_to_fp32(d[i * V + j]));
        } else {
          float* d = dl.f32();
#pragma omp parallel for schedule(static)
          for (int64_t i = 0; i < N; ++i)
            for (int64_t j = 0; j < V; ++j) d[i * V + j] *= -g[i];
        }
      }
      const float scale = computing() && !per_row ? dy.f32()[0] : 1.0f;
      if (scale != 1.0f) {  // in place: the tape runs once
        if (bf16) {
          uint16_t* d = dl.bf16();
#pragma omp parallel for schedule(static)
          for (int64_t i = 0; i < N * V; ++i)
            d[i] = kernels::fp32_to_bf16(scale * kernels::bf16_to_fp32(d[i]));
        } else {
          float* d = dl.f32();
#pragma omp parallel for schedule(static)
          for (int64_t i = 0; i < N * V; ++i) d[i] *= scale;
        }
      }
      if (gb) bias_gradient(gb, dl, N, V);
      linear_backward_products(dl, xv, wv, gx, gw, N, V, K, kLmHeadGemms);
    };
    record_backward("lm_head + cross_entropy", std::move(backward));
  }
  return out;
}

}  // namespace

Variable lm_head_cross_entropy(const Variable& x, const Variable& w, const Tensor& targets,
                               int64_t chunk_rows, int64_t normalizer, const Variable& b,
                               float softcap) {
  return lm_head_loss(x, w, targets, chunk_rows, normalizer, b, softcap, false);
}

Variable lm_head_log_probs(const Variable& x, const Variable& w, const Tensor& targets,
                           int64_t chunk_rows, const Variable& b, float softcap) {
  return lm_head_loss(x, w, targets, chunk_rows, 0, b, softcap, true);
}

}  // namespace cputrain
