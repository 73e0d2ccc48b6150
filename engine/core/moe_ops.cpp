#include "engine/core/moe_ops.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <tuple>
#include <utility>
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

// The experts' matrices of one product in w: expert e's (rows, cols) matrix is rows
// e * pitch + first onwards (pitch: its rows, or of the gate and up in one tensor, both).
struct ExpertMatrix {
  Tensor w;
  int64_t pitch = 0, first = 0;
  DType dtype() const { return w.dtype(); }
  int64_t row(int64_t e, int64_t r) const { return e * pitch + first + r; }
};

// Expert e's rows r0 .. r0 + n of its (.., cols) matrix of w (quantised).
kernels::QuantMatrix expert_quant(const ExpertMatrix& w, int64_t e, int64_t cols, int64_t r0,
                                  int64_t n) {
  kernels::QuantMatrix q{quant_type(w.dtype()), nullptr, n, cols};
  q.data = static_cast<const uint8_t*>(w.w.raw()) + w.row(e, r0) * q.row_bytes();
  return q;
}

// A share of one expert's product: columns c0 .. c1 of its output, along the dimension the
// product is split on.
struct ExpertTask {
  int64_t e, c0, c1;
};

// The tasks of one product over every expert with rows (rows of expert e at off[e] ..
// off[e + 1]), for one parallel pass: each expert whole, or, where its rows are over half a
// thread's fair share (a few tokens all sent to one expert), its `split` output columns in
// parts of whole 64s (where `splittable`); the most rows first, so that the threads end
// together.
std::vector<ExpertTask> expert_tasks(const std::vector<int64_t>& off, int64_t split,
                                     bool splittable) {
  const auto E = static_cast<int64_t>(off.size()) - 1;
  const int64_t share = std::max<int64_t>(1, off[E] / (2 * omp_get_max_threads()));
  std::vector<int64_t> experts;
  for (int64_t e = 0; e < E; ++e)
    if (off[e + 1] > off[e]) experts.push_back(e);
  std::stable_sort(experts.begin(), experts.end(), [&off](int64_t a, int64_t b) {
    return off[a + 1] - off[a] > off[b + 1] - off[b];
  });
  std::vector<ExpertTask> tasks;
  for (const int64_t e : experts) {
    const int64_t n = off[e + 1] - off[e];
    const int64_t parts = splittable ? std::clamp<int64_t>((n + share - 1) / share, 1,
                                                           std::max<int64_t>(1, split / 64))
                                     : 1;
    const int64_t width = ((split + parts - 1) / parts + 63) / 64 * 64;
    for (int64_t c0 = 0; c0 < split; c0 += width)
      tasks.push_back({e, c0, std::min(split, c0 + width)});
  }
  return tasks;
}

// Runs body(task) for each task, the tasks shared among OpenMP's threads, each product inside
// on its thread alone (kernels::GemmSerialScope); a single task runs on all threads.
template <class Body>
void run_tasks(const std::vector<ExpertTask>& tasks, Body&& body) {
  if (tasks.size() == 1) return body(tasks[0]);
#pragma omp parallel for schedule(dynamic, 1)
  for (size_t i = 0; i < tasks.size(); ++i) body(tasks[i]);
}

// While measuring: the buffers of a pass's products, `measure(thread)` for one product on all
// threads (a pass of one task) and for each thread of a parallel pass.
template <class Measure>
void measure_pass(Measure&& measure) {
  measure(-1);
  for (int t = 0; t < omp_get_max_threads(); ++t) measure(t);
}

// Columns t.c0 .. t.c1 of out (n, rows) = X W_e^T, X the n rows of x (of cols elements, bf16 or
// FP32) from row x0.
void expert_forward(const ExpertMatrix& w, const ExpertTask& t, int64_t rows, int64_t cols,
                    int64_t n, const Tensor& x, int64_t x0, float* out) {
  const bool bf16 = x.dtype() == DType::BF16;
  const int64_t m = t.c1 - t.c0;
  if (!dtype_quantized(w.dtype()))
    return product(Transpose::No, Transpose::Yes, n, m, cols, x, x0 * cols, cols, w.w,
                   w.row(t.e, t.c0) * cols, cols, 0.0f, out + t.c0, rows);
  const kernels::QuantMatrix q = expert_quant(w, t.e, cols, t.c0, m);
  if (bf16)
    kernels::gemm_quant_forward_bf16(n, x.bf16() + x0 * cols, cols, q, 0.0f, out + t.c0, rows);
  else
    kernels::gemm_quant_forward(n, x.f32() + x0 * cols, cols, q, 0.0f, out + t.c0, rows);
}

// Columns t.c0 .. t.c1 of dx (n, cols) = dY W_e + beta dx, dY the n rows of dy (of rows
// elements) from row d0; a quantised w's products take every column (a task of all of them).
void expert_input(const ExpertMatrix& w, const ExpertTask& t, int64_t rows, int64_t cols, int64_t n,
                  const Tensor& dy, int64_t d0, float beta, float* dx) {
  const bool bf16 = dy.dtype() == DType::BF16;
  if (!dtype_quantized(w.dtype()))
    return product(Transpose::No, Transpose::No, n, t.c1 - t.c0, rows, dy, d0 * rows, rows, w.w,
                   w.row(t.e, 0) * cols + t.c0, cols, beta, dx + t.c0, cols);
  const kernels::QuantMatrix q = expert_quant(w, t.e, cols, 0, rows);
  if (bf16)
    kernels::gemm_quant_backward_input_bf16(n, dy.bf16() + d0 * rows, rows, q, beta, dx, cols);
  else
    kernels::gemm_quant_backward_input(n, dy.f32() + d0 * rows, rows, q, beta, dx, cols);
}

// While measuring: the allocations of a pass of products by w of at most M rows an expert.
void measure_expert(const ExpertMatrix& w, bool bf16, bool forward, int64_t M, int64_t rows,
                    int64_t cols) {
  measure_pass([&](int thread) {
    if (dtype_quantized(w.dtype()))
      measure_quant_gemm(bf16, forward, M, rows, cols, thread);
    else if (forward)
      measure_gemm(bf16, Transpose::No, Transpose::Yes, M, rows, cols, thread);
    else
      measure_gemm(bf16, Transpose::No, Transpose::No, M, cols, rows, thread);
  });
}

// While measuring: the allocations of a pass of weight-gradient products dW (M, N) += dY^T X
// over at most K rows an expert.
void measure_weight_pass(bool bf16, int64_t M, int64_t N, int64_t K) {
  measure_pass(
      [&](int thread) { measure_gemm(bf16, Transpose::Yes, Transpose::No, M, N, K, thread); });
}

// sum over f of h[f] p[f] (h bf16 or FP32 as H is), in FP32.
float row_dot(const Tensor& H, int64_t offset, const float* p, int64_t n) {
  float sum = 0.0f;
  if (H.dtype() == DType::BF16) {
    const uint16_t* h = H.bf16() + offset;
#pragma omp simd reduction(+ : sum)
    for (int64_t f = 0; f < n; ++f) sum += kernels::bf16_to_fp32(h[f]) * p[f];
  } else {
    const float* h = H.f32() + offset;
#pragma omp simd reduction(+ : sum)
    for (int64_t f = 0; f < n; ++f) sum += h[f] * p[f];
  }
  return sum;
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

// One product's adapter inside moe_experts: A (E, r, in) and B (E, out, r) as the products take
// them, their gradients' cells, its dropout mask's seed, and what the forward keeps of it,
// s (drop(X_e) A_e^T) for each grouped row (R x r, in the products' precision).
struct ExpertAdapter {
  Tensor a, b;
  GradRef ga, gb;
  Tensor su;
  int64_t rows = 0;  // R, the grouped rows (offsets are not computed while measuring)
  int64_t r = 0, in = 0, out = 0;
  uint64_t seed = 0;
  bool on() const { return a.defined(); }
};

ExpertAdapter expert_adapter(const Variable& a, const Variable& b, int64_t E, int64_t rows,
                             int64_t in, int64_t out, bool bf16, uint64_t seed) {
  ExpertAdapter ad;
  require(a.defined() == b.defined(), "moe_experts: an adapter's A and B, or neither");
  if (!a.defined()) return ad;
  ad.r = a.shape()[1];
  require(a.value().ndim() == 3 && a.shape()[0] == E && a.shape()[2] == in &&
              b.value().ndim() == 3 && b.shape()[0] == E && b.shape()[1] == out &&
              b.shape()[2] == ad.r,
          "moe_experts: an adapter's A (E, r, in) and B (E, out, r)");
  ad.a = bf16 ? a.bf16_value() : a.value();
  ad.b = bf16 ? b.bf16_value() : b.value();
  ad.ga = a.grad_ref();
  ad.gb = b.grad_ref();
  ad.rows = rows;
  ad.in = in;
  ad.out = out;
  ad.seed = seed;
  return ad;
}

// The adapter's first product over the grouped rows `in` (R x ad.in) of every expert, kept as
// ad.su = s (drop(in) A_e^T); `most` rows an expert at most.
void adapter_forward(ExpertAdapter& ad, const Tensor& in, const std::vector<int64_t>& off,
                     int64_t most, float scale, float dropout, bool bf16) {
  const int64_t R = ad.rows, r = ad.r, K = ad.in;
  const Tensor u = Tensor::empty(Shape{R, r}, DType::F32, MemoryCategory::Workspace);
  {
    const Tensor xd = dropout > 0.0f ? dropped_out(in, dropout, ad.seed) : in;
    if (!computing())
      measure_pass([&](int thread) {
        measure_gemm(bf16, Transpose::No, Transpose::Yes, most, r, K, thread);
      });
    if (computing())
      run_tasks(expert_tasks(off, r, false), [&](const ExpertTask& t) {
        const int64_t n = off[t.e + 1] - off[t.e];
        product(Transpose::No, Transpose::Yes, n, r, K, xd, off[t.e] * K, K, ad.a, t.e * r * K, K,
                0.0f, u.f32() + off[t.e] * r, r);
      });
  }
  ad.su = scaled_operand(u, scale, bf16, MemoryCategory::Activations);
}

// While measuring: the allocations of the adapter's second product inside its product's pass.
void measure_adapter_add(const ExpertAdapter& ad, bool bf16, int64_t most) {
  if (ad.on())
    measure_pass([&](int thread) {
      measure_gemm(bf16, Transpose::No, Transpose::Yes, most, ad.out, ad.r, thread);
    });
}

// Columns t.c0 .. t.c1 of expert t.e's n output rows (out, leading dimension ad.out, the rows'
// first at `row0` of the grouping) += ad.su B_e^T.
void adapter_add(const ExpertAdapter& ad, const ExpertTask& t, int64_t n, int64_t row0,
                 float* out) {
  if (!ad.on()) return;
  product(Transpose::No, Transpose::Yes, n, t.c1 - t.c0, ad.r, ad.su, row0 * ad.r, ad.r, ad.b,
          (t.e * ad.out + t.c0) * ad.r, ad.r, 1.0f, out + t.c0, ad.out);
}

// g = d_e B_e for each expert's rows of d (R x ad.out, the product's output gradient), FP32
// (R x r).
Tensor adapter_g(const ExpertAdapter& ad, const Tensor& d, const std::vector<int64_t>& off,
                 int64_t most, bool bf16) {
  const int64_t R = ad.rows, r = ad.r, N = ad.out;
  Tensor g = Tensor::empty(Shape{R, r}, DType::F32, MemoryCategory::Workspace);
  if (!computing())
    measure_pass(
        [&](int thread) { measure_gemm(bf16, Transpose::No, Transpose::No, most, r, N, thread); });
  if (computing())
    run_tasks(expert_tasks(off, r, false), [&](const ExpertTask& t) {
      const int64_t n = off[t.e + 1] - off[t.e];
      product(Transpose::No, Transpose::No, n, r, N, d, off[t.e] * N, N, ad.b, t.e * N * r, r, 0.0f,
              g.f32() + off[t.e] * r, r);
    });
  return g;
}

// The adapter's weights' gradients: dB_e += d_e^T su_e, dA_e += sg_e^T drop(in)_e, with d the
// product's output gradient (R x ad.out), sg the gradient of u (R x r) and `in` the product's
// input (R x ad.in), all in the products' precision.
void adapter_weight_grads(const ExpertAdapter& ad, const Tensor& d, const Tensor& sg,
                          const Tensor& in, const std::vector<int64_t>& off, int64_t most,
                          float dropout, bool bf16) {
  if (!ad.ga && !ad.gb) return;
  const int64_t r = ad.r, K = ad.in, N = ad.out;
  const Tensor xd = ad.ga && dropout > 0.0f ? dropped_out(in, dropout, ad.seed) : in;
  if (!computing())
    measure_pass([&](int thread) {
      if (ad.gb) measure_gemm(bf16, Transpose::Yes, Transpose::No, N, r, most, thread);
      if (ad.ga) measure_gemm(bf16, Transpose::Yes, Transpose::No, r, K, most, thread);
    });
  const Tensor* db = ad.gb ? &ad.gb->get_or_zeros() : nullptr;
  const Tensor* da = ad.ga ? &ad.ga->get_or_zeros() : nullptr;
  if (computing())
    run_tasks(expert_tasks(off, r, false), [&](const ExpertTask& t) {
      const int64_t n = off[t.e + 1] - off[t.e];
      if (db)
        product(Transpose::Yes, Transpose::No, N, r, n, d, off[t.e] * N, N, ad.su, off[t.e] * r, r,
                1.0f, db->f32() + t.e * N * r, r);
      if (da)
        product(Transpose::Yes, Transpose::No, r, K, n, sg, off[t.e] * r, r, xd, off[t.e] * K, K,
                1.0f, da->f32() + t.e * r * K, K);
    });
}

// The adapter's share of its input's gradient: din (R x ad.in, FP32) += sg_e A_e for each
// expert's rows, masked and scaled as the forward's dropout took the input.
void adapter_input_grad(const ExpertAdapter& ad, const Tensor& sg, const std::vector<int64_t>& off,
                        int64_t most, float dropout, bool bf16, float* din) {
  const int64_t R = ad.rows, r = ad.r, K = ad.in;
  const Tensor t =
      dropout > 0.0f ? Tensor::empty(Shape{R, K}, DType::F32, MemoryCategory::Workspace) : Tensor();
  float* const dst = dropout > 0.0f ? t.f32() : din;
  if (!computing())
    measure_pass(
        [&](int thread) { measure_gemm(bf16, Transpose::No, Transpose::No, most, K, r, thread); });
  if (!computing()) return;
  run_tasks(expert_tasks(off, K, true), [&](const ExpertTask& task) {
    const int64_t n = off[task.e + 1] - off[task.e];
    product(Transpose::No, Transpose::No, n, task.c1 - task.c0, r, sg, off[task.e] * r, r, ad.a,
            task.e * r * K + task.c0, K, dropout > 0.0f ? 0.0f : 1.0f,
            dst + off[task.e] * K + task.c0, K);
  });
  if (dropout > 0.0f) {
    const uint32_t threshold = dropout_threshold(dropout);
    const float keep = 1.0f / (1.0f - dropout);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < R * K; ++i)
      if (dropout_keeps(ad.seed, i, threshold)) din[i] += keep * dst[i];
  }
}

// Columns t.c0 .. t.c1 of expert t.e's n rows of out (leading dimension cols) += its row of b
// (E, cols; undefined: nothing).
void add_bias(const Tensor& b, const ExpertTask& t, int64_t n, int64_t cols, float* out) {
  if (!b.defined()) return;
  const float* row = b.f32() + t.e * cols;
  for (int64_t i = 0; i < n; ++i)
#pragma omp simd
    for (int64_t c = t.c0; c < t.c1; ++c) out[i * cols + c] += row[c];
}

// The expert of grouped row r.
int64_t expert_of(const std::vector<int64_t>& off, int64_t r) {
  return std::upper_bound(off.begin(), off.end(), r) - off.begin() - 1;
}

// A bias's gradient (E, cols) += for each expert the sum over its grouped rows r of
// add_row(r, dst), which adds row r's share into dst (cols values); one expert a thread.
template <class AddRow>
void bias_grad(const GradRef& cell, const std::vector<int64_t>& off, int64_t cols,
               AddRow&& add_row) {
  const Tensor& g = cell->get_or_zeros();
  if (!computing()) return;
  const auto E = static_cast<int64_t>(off.size()) - 1;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = off[e]; r < off[e + 1]; ++r) add_row(r, g.f32() + e * cols);
}

// add_row for bias_grad: row r of d (R x cols, bf16 or FP32).
auto rows_of(const Tensor& d, int64_t cols) {
  return [&d, cols](int64_t r, float* dst) {
    if (d.dtype() == DType::BF16) {
      const uint16_t* row = d.bf16() + r * cols;
      for (int64_t c = 0; c < cols; ++c) dst[c] += kernels::bf16_to_fp32(row[c]);
    } else {
      const float* row = d.f32() + r * cols;
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) dst[c] += row[c];
    }
  };
}

// What MoeLoadCount counts, and where the next router's count goes.
struct LoadCounts {
  bool on = false;
  size_t next = 0;
  std::vector<MoeLoad> loads;
};

// The router losses' weights MoeRouterLossScope sets.
struct RouterLossWeights {
  float balance = 0.0f;
  float z = 0.0f;
};

RouterLossWeights& router_loss_weights() {
  static RouterLossWeights weights;
  return weights;
}

LoadCounts& load_counts() {
  static LoadCounts counts;
  return counts;
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
  Tensor lse = new_activation(softmax ? Shape{N} : Shape{1});  // for the router's losses
  Tensor experts = new_activation(Shape{N, k}, DType::I32);
  Tensor weights = new_activation(Shape{N, k});
  if (computing())
    kernels::moe_route_forward(fp32_value(logits).f32(), N, E, k, gating, normalize, probs.f32(),
                               experts.i32(), weights.f32(), softmax ? lse.f32() : nullptr);
  LoadCounts& counts = load_counts();
  if (computing() && counts.on) {
    if (counts.loads.size() <= counts.next) counts.loads.resize(counts.next + 1);
    MoeLoad& load = counts.loads[counts.next++];
    load.tokens.resize(static_cast<size_t>(E), 0);
    for (int64_t i = 0; i < N * k; ++i) ++load.tokens[static_cast<size_t>(experts.i32()[i])];
    if (softmax) {
      const kernels::MoeRouterLosses l =
          kernels::moe_router_losses(probs.f32(), lse.f32(), experts.i32(), N, E, k);
      load.balance += l.balance;
      load.z += l.z;
      load.losses = true;
    }
    ++load.passes;
  }
  // The router's losses' weights, as they are while the pass is recorded (a checkpoint region's
  // second forward runs inside the same step's scope).
  const RouterLossWeights aux = softmax ? router_loss_weights() : RouterLossWeights{};
  MoeRouting out{Variable::op_output(weights, grad), experts};
  if (grad) {
    record_backward("moe route", [probs, lse, experts, weights, gl = logits.grad_ref(),
                                  gw = out.weights.grad_ref(), N, E, k, gating, normalize, aux] {
      const Tensor& dw = gw->tensor();
      const bool losses = aux.balance != 0.0f || aux.z != 0.0f;
      if (!dw.defined() && !losses) return;
      const OverwrittenGradient dl(gl, Shape{N, E});
      if (!computing()) return;
      if (dw.defined())
        kernels::moe_route_backward(probs.f32(), experts.i32(), weights.f32(), as_f32(dw).f32(), N,
                                    E, k, gating, normalize, dl.data());
      else
        std::fill_n(dl.data(), N * E, 0.0f);
      if (losses)
        kernels::moe_router_losses_backward(probs.f32(), lse.f32(), experts.i32(), N, E, k,
                                            aux.balance, aux.z, dl.data());
      dl.add_to_cell();
    });
  }
  return out;
}

Variable moe_experts(const Variable& x, const Variable& w1, const Variable& w3, const Variable& w2,
                     const MoeRouting& route, const MoeAdapters& lora, const MoeBiases& biases,
                     kernels::Activation act) {
  const Shape& xs = x.shape();
  const int64_t C = xs[xs.ndim() - 1], N = x.value().numel() / C;
  // w3 undefined: w1 holds each expert's gate rows and then its up rows.
  const bool fused = !w3.defined();
  require(w1.value().ndim() == 3 && w2.value().ndim() == 3 && w1.shape()[2] == C &&
              w2.shape()[0] == w1.shape()[0] && w2.shape()[1] == C &&
              (fused ? w1.shape()[1] == 2 * w2.shape()[2]
                     : w1.shape() == w3.shape() && w2.shape()[2] == w1.shape()[1]),
          "moe_experts: x (..., C), w1 and w3 (E, F, C) or w1 alone (E, 2 F, C), w2 (E, C, F)");
  const int64_t E = w1.shape()[0], F = w2.shape()[2], k = route.experts.shape()[1];
  require(route.experts.numel() == N * k && route.weights.value().numel() == N * k,
          "moe_experts: a routing of x's rows");
  const auto bias_of = [](const Variable& b, int64_t E, int64_t n) {
    require(!b.defined() || b.shape() == Shape{E, n},
            "moe_experts: biases b1, b3 (E, F), b2 (E, C)");
    return b.defined() ? fp32_value(b) : Tensor();
  };
  const Tensor b1v = bias_of(biases.b1, E, F), b3v = bias_of(biases.b3, E, F),
               b2v = bias_of(biases.b2, E, C);
  Scope scope("moe experts", Pass::Forward);
  const bool bf16 = bf16_mode();
  const DType operand = bf16 ? DType::BF16 : DType::F32;
  const Tensor xv = bf16 ? x.bf16_value() : fp32_value(x);
  const Tensor w1t = weight_operand(w1, bf16);
  const ExpertMatrix w1v{w1t, fused ? 2 * F : F, 0},
      w3v{fused ? w1t : weight_operand(w3, bf16), fused ? 2 * F : F, fused ? F : 0},
      w2v{weight_operand(w2, bf16), C, 0};
  require((!dtype_quantized(w1v.dtype()) || !w1.requires_grad()) &&
              (!dtype_quantized(w3v.dtype()) || fused || !w3.requires_grad()) &&
              (!dtype_quantized(w2v.dtype()) || !w2.requires_grad()),
          "moe_experts: a quantised expert takes no gradient");
  // The adapters, each product's mask seeded apart.
  const float scale = lora.scale, dropout = lora.dropout;
  auto ad1 = std::make_shared<ExpertAdapter>(
      expert_adapter(lora.a1, lora.b1, E, N * k, C, F, bf16, lora.seed));
  auto ad3 = std::make_shared<ExpertAdapter>(
      expert_adapter(lora.a3, lora.b3, E, N * k, C, F, bf16, splitmix64(lora.seed + 1)));
  auto ad2 = std::make_shared<ExpertAdapter>(
      expert_adapter(lora.a2, lora.b2, E, N * k, F, C, bf16, splitmix64(lora.seed + 2)));
  const bool grad = needs_grad({&x, &w1, &w3, &w2, &route.weights, &lora.a1, &lora.b1, &lora.a3,
                                &lora.b3, &lora.a2, &lora.b2, &biases.b1, &biases.b3, &biases.b2});
  // The backward pass reads the activation for the weights', w2's and its adapter's A's
  // gradients alone.
  const bool keep_h = needs_grad({&w2, &route.weights, &lora.a2});
  const int64_t R = N * k;              // rows of the grouped products
  const int64_t most = std::min(N, R);  // an expert's rows at most (a token takes it once)
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
  // The gate and up products; kept for the backward pass (FP32; in bf16 mode their roundings,
  // with the activation's, as the dense MLP keeps them). In bf16 mode the FP32 products and then
  // the down product's rows share one block (fewer blocks for the allocator's cache to keep).
  Tensor G, U, ws;
  float *g32, *u32;
  if (bf16) {
    ws = Tensor::empty(Shape{R, std::max(C, 2 * F)}, DType::F32, MemoryCategory::Workspace);
    g32 = ws.f32();
    u32 = g32 + R * F;
  } else {
    G = new_activation(Shape{R, F});
    U = new_activation(Shape{R, F});
    g32 = G.f32();
    u32 = U.f32();
  }
  {
    Scope gemms("moe GEMMs gate, up", Pass::Forward, 2 * gemm_flops(R, F, C));
    for (ExpertAdapter* ad : {ad1.get(), ad3.get()})
      if (ad->on()) adapter_forward(*ad, xg, off, most, scale, dropout, bf16);
    if (!computing()) {
      measure_expert(w1v, bf16, true, most, F, C);
      measure_adapter_add(*ad1, bf16, most);
      measure_adapter_add(*ad3, bf16, most);
    }
    if (computing())
      run_tasks(expert_tasks(off, F, true), [&](const ExpertTask& t) {
        const int64_t n = off[t.e + 1] - off[t.e];
        expert_forward(w1v, t, F, C, n, xg, off[t.e], g32 + off[t.e] * F);
        adapter_add(*ad1, t, n, off[t.e], g32 + off[t.e] * F);
        add_bias(b1v, t, n, F, g32 + off[t.e] * F);
        expert_forward(w3v, t, F, C, n, xg, off[t.e], u32 + off[t.e] * F);
        adapter_add(*ad3, t, n, off[t.e], u32 + off[t.e] * F);
        add_bias(b3v, t, n, F, u32 + off[t.e] * F);
      });
  }
  xg = Tensor();
  Tensor H, G16, U16;
  if (bf16) {
    H = keep_h ? new_activation(Shape{R, F}, DType::BF16)
               : Tensor::empty(Shape{R, F}, DType::BF16, MemoryCategory::Workspace);
    if (grad) {
      G16 = new_activation(Shape{R, F}, DType::BF16);
      U16 = new_activation(Shape{R, F}, DType::BF16);
    }
    if (computing())
      kernels::swiglu_forward_bf16(H.bf16(), grad ? G16.bf16() : nullptr,
                                   grad ? U16.bf16() : nullptr, g32, u32, R * F, act);
    G = G16;
    U = U16;
  } else {
    H = Tensor::empty(Shape{R, F}, DType::F32, MemoryCategory::Workspace);
    if (computing()) kernels::swiglu_forward(H.f32(), g32, u32, R * F, act);
  }
  Tensor Y = bf16 ? ws : Tensor::empty(Shape{R, C}, DType::F32, MemoryCategory::Workspace);
  ws = Tensor();
  {
    Scope gemms("moe GEMMs down", Pass::Forward, gemm_flops(R, C, F));
    if (ad2->on()) adapter_forward(*ad2, H, off, most, scale, dropout, bf16);
    if (!computing()) {
      measure_expert(w2v, bf16, true, most, C, F);
      measure_adapter_add(*ad2, bf16, most);
    }
    if (computing())
      run_tasks(expert_tasks(off, C, true), [&](const ExpertTask& t) {
        const int64_t n = off[t.e + 1] - off[t.e];
        expert_forward(w2v, t, C, F, n, H, off[t.e], Y.f32() + off[t.e] * C);
        adapter_add(*ad2, t, n, off[t.e], Y.f32() + off[t.e] * C);
        add_bias(b2v, t, n, C, Y.f32() + off[t.e] * C);
      });
  }
  // FP32 mode computes the activation again in the backward pass; bf16 mode keeps it.
  if (!bf16 || !keep_h) H = Tensor();
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
  Variable out = Variable::op_output(y, grad);
  if (!grad) return out;
  record_backward("moe experts", [group, G, U, H, xv, w1v, w3v, w2v, wt, ad1, ad3, ad2, b2v,
                                  gx = x.grad_ref(), g1 = w1.grad_ref(), g3 = w3.grad_ref(),
                                  g2 = w2.grad_ref(), gw = route.weights.grad_ref(),
                                  gb1 = biases.b1.grad_ref(), gb3 = biases.b3.grad_ref(),
                                  gb2 = biases.b2.grad_ref(), gy = out.grad_ref(), N, C, F, k, R,
                                  most, bf16, operand, scale, dropout, act, fused] {
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
    // P = dY w2[e] (R x F), the gradient of the activation before the weight; later the rows
    // of dX (R x C) in the same block.
    Tensor ws = Tensor::empty(Shape{R, std::max(C, F)}, DType::F32, MemoryCategory::Workspace);
    float* const P = ws.f32();
    {
      Scope gemms("moe GEMMs dH", Pass::Backward, gemm_flops(R, F, C));
      if (!computing()) measure_expert(w2v, bf16, false, most, C, F);
      if (computing())
        run_tasks(expert_tasks(off, F, !dtype_quantized(w2v.dtype())), [&](const ExpertTask& t) {
          const int64_t n = off[t.e + 1] - off[t.e];
          expert_input(w2v, t, C, F, n, dyg, off[t.e], 0.0f, P + off[t.e] * F);
        });
    }
    // The down adapter's g2 = dY B2[e] (R x r, unweighted).
    const Tensor g2a = ad2->on() ? adapter_g(*ad2, dyg, off, most, bf16) : Tensor();
    // The activation (kept in bf16 mode, computed again in FP32 mode as the down product took
    // it), the weights' gradient (H . P, and s u2 . g2 of the adapter) and dH = weight P.
    Tensor h = H;
    if (!bf16 && (gw || g2 || ad2->ga)) {
      h = Tensor::empty(Shape{R, F}, DType::F32, MemoryCategory::Workspace);
      if (computing()) kernels::swiglu_forward(h.f32(), G.f32(), U.f32(), R * F, act);
    }
    Tensor dweights = Tensor::empty(Shape{N, k}, DType::F32, MemoryCategory::Workspace);
    if (computing()) {
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < R; ++r) {
        float* p = P + r * F;
        if (gw)
          dweights.f32()[order[r]] =
              row_dot(h, r * F, p, F) +
              (ad2->on() ? row_dot(ad2->su, r * ad2->r, g2a.f32() + r * ad2->r, ad2->r) : 0.0f) +
              (b2v.defined() ? row_dot(b2v, expert_of(off, r) * C,
                                       dy.f32() + static_cast<int64_t>(order[r] / k) * C, C)
                             : 0.0f);
        const float w = wt.f32()[order[r]];
        for (int64_t f = 0; f < F; ++f) p[f] *= w;
      }
    }
    // The down adapter: u2's gradient s weight g2, and dH += s weight g2 A2[e].
    Tensor sg2;
    if (ad2->on()) {
      const int64_t r2 = ad2->r;
      sg2 = Tensor::empty(Shape{R, r2}, operand, MemoryCategory::Workspace);
      if (computing())
#pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < R; ++r) {
          const float w = scale * wt.f32()[order[r]];
          for (int64_t j = 0; j < r2; ++j) {
            const float v = w * g2a.f32()[r * r2 + j];
            if (bf16)
              sg2.bf16()[r * r2 + j] = kernels::fp32_to_bf16(v);
            else
              sg2.f32()[r * r2 + j] = v;
          }
        }
      Scope gemms("moe GEMMs adapters dH", Pass::Backward, gemm_flops(R, F, r2));
      adapter_input_grad(*ad2, sg2, off, most, dropout, bf16, P);
    }
    if (gw) {
      float beta = 0.0f;
      float* d = gw->get_for_accumulate(&beta).f32();
      if (computing())
        // beta 0: d holds garbage, which is not to be read (0 times NaN is NaN).
        for (int64_t i = 0; i < N * k; ++i)
          d[i] = beta == 0.0f ? dweights.f32()[i] : dweights.f32()[i] + d[i];
    }
    if (g2 || ad2->gb) {
      // (weight dY) for dW2[e] += (weight dY)^T H and the adapter's B.
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
    }
    // db2[e] += the sum of its rows' weighted output gradients.
    if (gb2)
      bias_grad(gb2, off, C, [&](int64_t r, float* dst) {
        const float w = wt.f32()[order[r]];
        const float* row = dy.f32() + static_cast<int64_t>(order[r] / k) * C;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) dst[c] += w * row[c];
      });
    if (ad2->on()) {
      Scope gemms("moe GEMMs adapters dW2", Pass::Backward, 2 * gemm_flops(C + F, ad2->r, R));
      adapter_weight_grads(*ad2, dyg, sg2, h, off, most, dropout, bf16);
    }
    if (g2) {
      const Tensor& dw2 = g2->get_or_zeros();
      Scope gemms("moe GEMMs dW2", Pass::Backward, gemm_flops(C, F, R));
      if (!computing()) measure_weight_pass(bf16, C, F, most);
      if (computing())
        run_tasks(expert_tasks(off, C, true), [&](const ExpertTask& t) {
          const int64_t n = off[t.e + 1] - off[t.e];
          product(Transpose::Yes, Transpose::No, t.c1 - t.c0, F, n, dyg, off[t.e] * C + t.c0, C, h,
                  off[t.e] * F, F, 1.0f, dw2.f32() + (t.e * C + t.c0) * F, F);
        });
    }
    dyg = Tensor();
    h = Tensor();
    sg2 = Tensor();
    // dG, dU from dH (P), in the products' precision.
    Tensor dG = Tensor::empty(Shape{R, F}, operand, MemoryCategory::Workspace);
    Tensor dU = Tensor::empty(Shape{R, F}, operand, MemoryCategory::Workspace);
    if (computing()) {
      if (bf16)
        kernels::swiglu_backward_rounded(dG.bf16(), dU.bf16(), P, G.bf16(), U.bf16(), R * F, act);
      else
        kernels::swiglu_backward(dG.f32(), dU.f32(), P, G.f32(), U.f32(), R * F, false, act);
    }
    // db1[e], db3[e] += the sums of its rows of dG and dU.
    if (gb1) bias_grad(gb1, off, F, rows_of(dG, F));
    if (gb3) bias_grad(gb3, off, F, rows_of(dU, F));
    // The gate and up adapters: u's gradient s dG B1[e] (and s dU B3[e]).
    Tensor sg1, sg3;
    for (auto [ad, d, sg] : {std::tuple(ad1.get(), &dG, &sg1), std::tuple(ad3.get(), &dU, &sg3)})
      if (ad->on())
        *sg = scaled_operand(adapter_g(*ad, *d, off, most, bf16), scale, bf16,
                             MemoryCategory::Workspace);
    if (g1 || g3 || ad1->ga || ad1->gb || ad3->ga || ad3->gb) {
      ws = Tensor();  // P is spent: its block is not held through the gathered rows
      Tensor xg = Tensor::empty(Shape{R, C}, operand, MemoryCategory::Workspace);
      if (computing()) gather_rows(xg, xv, order, R, k, C);
      for (auto [ad, d, sg] : {std::tuple(ad1.get(), &dG, &sg1), std::tuple(ad3.get(), &dU, &sg3)})
        if (ad->on()) {
          Scope gemms("moe GEMMs adapters dW1, dW3", Pass::Backward,
                      2 * gemm_flops(F + C, ad->r, R));
          adapter_weight_grads(*ad, *d, *sg, xg, off, most, dropout, bf16);
        }
      if (g1 || g3) {
        Scope gemms("moe GEMMs dW1, dW3", Pass::Backward, 2 * gemm_flops(F, C, R));
        if (!computing()) measure_weight_pass(bf16, F, C, most);
        // Fused, one gradient of each expert's gate rows and then its up rows.
        const Tensor* dw1 = g1 ? &g1->get_or_zeros() : nullptr;
        const Tensor* dw3 = fused ? dw1 : g3 ? &g3->get_or_zeros() : nullptr;
        if (computing())
          run_tasks(expert_tasks(off, F, true), [&](const ExpertTask& t) {
            const int64_t n = off[t.e + 1] - off[t.e], m = t.c1 - t.c0;
            if (dw1)
              product(Transpose::Yes, Transpose::No, m, C, n, dG, off[t.e] * F + t.c0, F, xg,
                      off[t.e] * C, C, 1.0f, dw1->f32() + w1v.row(t.e, t.c0) * C, C);
            if (dw3)
              product(Transpose::Yes, Transpose::No, m, C, n, dU, off[t.e] * F + t.c0, F, xg,
                      off[t.e] * C, C, 1.0f, dw3->f32() + w3v.row(t.e, t.c0) * C, C);
          });
      }
    }
    if (gx) {
      if (!ws.defined()) ws = Tensor::empty(Shape{R, C}, DType::F32, MemoryCategory::Workspace);
      float* const dxg = ws.f32();
      {
        Scope gemms("moe GEMMs dX", Pass::Backward, 2 * gemm_flops(R, C, F));
        if (!computing()) measure_expert(w1v, bf16, false, most, F, C);
        const bool splittable = !dtype_quantized(w1v.dtype()) && !dtype_quantized(w3v.dtype());
        if (computing())
          run_tasks(expert_tasks(off, C, splittable), [&](const ExpertTask& t) {
            const int64_t n = off[t.e + 1] - off[t.e];
            expert_input(w1v, t, F, C, n, dG, off[t.e], 0.0f, dxg + off[t.e] * C);
            expert_input(w3v, t, F, C, n, dU, off[t.e], 1.0f, dxg + off[t.e] * C);
          });
      }
      for (auto [ad, sg] : {std::pair(ad1.get(), &sg1), std::pair(ad3.get(), &sg3)})
        if (ad->on()) {
          Scope gemms("moe GEMMs adapters dX", Pass::Backward, gemm_flops(R, C, ad->r));
          adapter_input_grad(*ad, *sg, off, most, dropout, bf16, dxg);
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
            const float* row = dxg + static_cast<int64_t>(pos[t * k + j]) * C;
            for (int64_t c = 0; c < C; ++c) d[c] += row[c];
          }
        }
      }
    }
  });
  return out;
}

MoeLoadCount::MoeLoadCount() {
  LoadCounts& counts = load_counts();
  counts.on = true;
  counts.next = 0;
}

MoeLoadCount::~MoeLoadCount() {
  load_counts().on = false;
}

std::vector<MoeLoad> moe_load_take() {
  return std::exchange(load_counts().loads, {});
}

MoeRouterLossScope::MoeRouterLossScope(float balance_weight, float z_weight)
    : balance_(router_loss_weights().balance), z_(router_loss_weights().z) {
  router_loss_weights() = {balance_weight, z_weight};
}

MoeRouterLossScope::~MoeRouterLossScope() {
  router_loss_weights() = {balance_, z_};
}

MoeRouting moe_expert_scaled(const MoeRouting& route, const Variable& scale) {
  const Tensor experts = route.experts;
  const int64_t n = experts.numel(), E = scale.value().numel();
  require(route.weights.value().numel() == n && scale.shape().ndim() == 1,
          "moe_expert_scaled: weights (N, k) and a scale (E)");
  Scope scope("expert scale", Pass::Forward);
  Tensor y = new_activation(route.weights.shape());
  const Tensor wv = fp32_value(route.weights), sv = fp32_value(scale);
  if (computing())
    for (int64_t i = 0; i < n; ++i) {
      const int32_t e = experts.i32()[i];
      require(e >= 0 && e < E, "moe_expert_scaled: an expert beyond the scale's");
      y.f32()[i] = wv.f32()[i] * sv.f32()[e];
    }
  const bool grad = needs_grad({&route.weights, &scale});
  Variable out = Variable::op_output(y, grad);
  if (grad)
    record_backward("expert scale", [wv, sv, experts, n, E, gw = route.weights.grad_ref(),
                                     gs = scale.grad_ref(), gy = out.grad_ref()] {
      const Tensor& dyt = gy->tensor();
      if (!dyt.defined()) return;
      const Tensor dy = as_f32(dyt);
      float bw = 0.0f, bs = 0.0f;
      float* dw = gw ? gw->get_for_accumulate(&bw).f32() : nullptr;
      float* ds = gs ? gs->get_for_accumulate(&bs).f32() : nullptr;
      if (!computing()) return;
      std::vector<double> sums(static_cast<size_t>(E), 0.0);
      for (int64_t i = 0; i < n; ++i) {
        const int32_t e = experts.i32()[i];
        const float d = dy.f32()[i];
        if (dw) dw[i] = bw == 0.0f ? d * sv.f32()[e] : d * sv.f32()[e] + dw[i];
        sums[static_cast<size_t>(e)] += static_cast<double>(d) * wv.f32()[i];
      }
      if (ds)
        for (int64_t e = 0; e < E; ++e) {
          const auto g = static_cast<float>(sums[static_cast<size_t>(e)]);
          ds[e] = bs == 0.0f ? g : g + ds[e];
        }
    });
  return {out, experts};
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
