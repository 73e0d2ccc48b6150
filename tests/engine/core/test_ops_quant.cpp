// The ops over a frozen weight held quantised (engine/core/tensor.h's quantised dtypes, as a GGUF
// file's tensors are mapped): each against the same op over the weight's dequantised values, in
// FP32 and in bf16 compute, for every format; and a LoRA's gradients over a quantised base
// against central differences.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "engine/core/moe_ops.h"
#include "engine/core/ops.h"
#include "kernels/gemm/gemm.h"
#include "kernels/kernel_test_util.h"

namespace cputrain {
namespace {

const DType kQuantised[] = {DType::Q4_0, DType::Q5_0, DType::Q5_1, DType::Q8_0,
                            DType::Q4_K, DType::Q5_K, DType::Q6_K};

Tensor random_tensor(const Shape& shape, std::mt19937& rng, float scale = 1.0f) {
  Tensor t = Tensor::empty(shape, DType::F32, MemoryCategory::Workspace);
  std::normal_distribution<float> dist(0.0f, scale);
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = dist(rng);
  return t;
}

// A (rows, cols) matrix of random blocks of `dtype`.
Tensor random_quantised(DType dtype, int64_t rows, int64_t cols, uint32_t seed) {
  Tensor t = Tensor::empty(Shape{rows, cols}, dtype, MemoryCategory::Workspace);
  const kernels::QuantType q = quant_type(dtype);
  const std::vector<uint8_t> blocks =
      kernels::test::random_quant_blocks(q, rows * cols / kernels::quant_block_values(q), seed);
  EXPECT_EQ(blocks.size(), t.bytes());
  std::memcpy(t.raw(), blocks.data(), blocks.size());
  return t;
}

Tensor dequantised(const Tensor& q) {
  Tensor t = Tensor::empty(q.shape(), DType::F32, MemoryCategory::Workspace);
  kernels::dequantize_rows(q.quant(), 0, q.dim(0), t.f32());
  return t;
}

// The largest |a - b| over the largest |b|.
double relative_difference(const Tensor& a, const Tensor& b) {
  double worst = 0.0, size = 1e-30;
  for (int64_t i = 0; i < a.numel(); ++i) {
    worst = std::max(worst, std::abs(static_cast<double>(a.f32()[i]) - b.f32()[i]));
    size = std::max(size, std::abs(static_cast<double>(b.f32()[i])));
  }
  return worst / size;
}

struct LoraRun {
  Tensor y, dx, da, db, dbias;
};

// lora_linear(x, w, bias, a, b) and its gradients for the output gradient r, in `compute`.
LoraRun run_lora(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& a,
                 const Tensor& b, const Tensor& r, DType compute) {
  ComputeDTypeGuard precision(compute);
  Variable vx(x, true), vw(w, false), vbias(bias, true), va(a, true), vb(b, true);
  const Variable y = lora_linear(vx, vw, vbias, va, vb, 0.75f);
  backward(y, r);
  return {y.value(), vx.grad(), va.grad(), vb.grad(), vbias.grad()};
}

// Whether the GEMM's product of X with a panel of W's rows gives, bitwise, those columns of the
// product with the whole W: our blocked GEMMs (and the reference loop) sum each element over K
// alike whatever N is; oneDNN's and Eigen's order may depend on N.
bool panels_sum_as_whole() {
  const kernels::GemmBackend b = kernels::gemm_backend();
  return b != kernels::GemmBackend::Onednn && b != kernels::GemmBackend::Eigen;
}

// Over every format, in FP32 and bf16 compute: the output is bitwise the op's over the
// dequantised W (each panel's product is the GEMM's over the whole K), within rounding under
// oneDNN and Eigen (panels_sum_as_whole); the gradients of the
// adapters and the bias too (they do not read W); x's gradient, whose product over W sums panel
// by panel, within FP32 rounding of it. M above the few rows of decoding; N over two panels.
TEST(OpsQuant, LoraLinearOverAQuantisedWeightIsOverItsValues) {
  std::mt19937 rng(5);
  for (const DType dtype : kQuantised) {
    const int64_t K = 2048, N = kernels::quant_panel_rows(K) + 6, M = 9, r = 3;
    const Tensor wq = random_quantised(dtype, N, K, 9);
    const Tensor wd = dequantised(wq);
    const Tensor x = random_tensor(Shape{M, K}, rng), bias = random_tensor(Shape{N}, rng);
    const Tensor a = random_tensor(Shape{r, K}, rng, 0.1f), b = random_tensor(Shape{N, r}, rng);
    const Tensor out_grad = random_tensor(Shape{M, N}, rng);
    for (const DType compute : {DType::F32, DType::BF16}) {
      const std::string what =
          std::string(dtype_name(dtype)) + " " + std::string(dtype_name(compute));
      const LoraRun q = run_lora(x, wq, bias, a, b, out_grad, compute);
      const LoraRun d = run_lora(x, wd, bias, a, b, out_grad, compute);
      if (panels_sum_as_whole()) {
        for (int64_t i = 0; i < M * N; ++i) ASSERT_EQ(q.y.f32()[i], d.y.f32()[i]) << what << i;
      } else {
        EXPECT_LT(relative_difference(q.y, d.y), 1e-5) << what;
      }
      for (int64_t i = 0; i < r * K; ++i) ASSERT_EQ(q.da.f32()[i], d.da.f32()[i]) << what;
      for (int64_t i = 0; i < N * r; ++i) ASSERT_EQ(q.db.f32()[i], d.db.f32()[i]) << what;
      for (int64_t i = 0; i < N; ++i) ASSERT_EQ(q.dbias.f32()[i], d.dbias.f32()[i]) << what;
      EXPECT_LT(relative_difference(q.dx, d.dx), 1e-5) << what;
    }
  }
}

// linear and linear_rounded (bf16 output) over a quantised W, with and without a bias, and the
// few rows of decoding (each row of W decoded once, dotted in another order: within rounding).
TEST(OpsQuant, LinearOverAQuantisedWeightIsOverItsValues) {
  std::mt19937 rng(6);
  for (const DType dtype : kQuantised) {
    const int64_t K = kernels::quant_block_values(quant_type(dtype)), N = 21;
    const Tensor wq = random_quantised(dtype, N, K, 10);
    const Tensor wd = dequantised(wq);
    const Tensor bias = random_tensor(Shape{N}, rng);
    for (const int64_t M : {int64_t{1}, int64_t{3}, int64_t{29}}) {
      const Tensor x = random_tensor(Shape{M, K}, rng);
      for (const DType compute : {DType::F32, DType::BF16}) {
        ComputeDTypeGuard precision(compute);
        NoGradGuard no_grad;
        const std::string what = std::string(dtype_name(dtype)) + " " +
                                 std::string(dtype_name(compute)) + " M " + std::to_string(M);
        const Variable vx(x, false), vq(wq, false), vd(wd, false), vb(bias, false);
        const Tensor yq = linear(vx, vq, vb).value(), yd = linear(vx, vd, vb).value();
        if (M > kernels::kQuantRowsM) {
          for (int64_t i = 0; i < M * N; ++i) ASSERT_EQ(yq.f32()[i], yd.f32()[i]) << what;
        } else {
          EXPECT_LT(relative_difference(yq, yd), 1e-6) << what;
        }
        if (compute != DType::BF16 || M <= kernels::kQuantRowsM) continue;
        for (const bool with_bias : {false, true}) {
          const Variable none;
          const Tensor rq = linear_rounded(vx, vq, with_bias ? vb : none).value();
          const Tensor rd = linear_rounded(vx, vd, with_bias ? vb : none).value();
          ASSERT_EQ(rq.dtype(), DType::BF16);
          for (int64_t i = 0; i < M * N; ++i) ASSERT_EQ(rq.bf16()[i], rd.bf16()[i]) << what;
        }
      }
    }
  }
}

// The embedding's lookup from a quantised table is its dequantised rows, scaled; the LM head's
// loss and x's gradient over a quantised W are those over its values (the gradient's product
// within rounding).
TEST(OpsQuant, EmbeddingAndHeadOverAQuantisedTable) {
  std::mt19937 rng(7);
  for (const DType dtype : kQuantised) {
    const int64_t C = kernels::quant_block_values(quant_type(dtype)), V = 23, N = 9;
    const Tensor table = random_quantised(dtype, V, C, 11);
    const Tensor values = dequantised(table);
    Tensor tokens = Tensor::empty(Shape{1, N}, DType::I32, MemoryCategory::Workspace);
    for (int64_t i = 0; i < N; ++i) tokens.i32()[i] = static_cast<int32_t>((i * 7 + 3) % V);
    {
      NoGradGuard no_grad;
      const Tensor e = embedding(Variable(table, false), tokens, 1.5f).value();
      const Tensor f = embedding(Variable(values, false), tokens, 1.5f).value();
      for (int64_t i = 0; i < N * C; ++i) ASSERT_EQ(e.f32()[i], f.f32()[i]) << dtype_name(dtype);
    }
    const Tensor x = random_tensor(Shape{1, N, C}, rng, 0.1f);
    for (const DType compute : {DType::F32, DType::BF16}) {
      ComputeDTypeGuard precision(compute);
      const auto head = [&](const Tensor& w, Tensor* dx) {
        Variable vx(x, true);
        const Variable loss = lm_head_cross_entropy(vx, Variable(w, false), tokens);
        backward(loss);
        *dx = vx.grad();
        return loss.value().f32()[0];
      };
      Tensor dq, dd;
      const float lq = head(table, &dq), ld = head(values, &dd);
      EXPECT_EQ(lq, ld) << dtype_name(dtype) << " " << dtype_name(compute);
      EXPECT_LT(relative_difference(dq, dd), 1e-6)
          << dtype_name(dtype) << " " << dtype_name(compute);
    }
  }
}

// A LoRA over a quantised base (FP32 compute): the gradients of x, the bias and both adapters
// against central differences of a random projection of the output, in double.
TEST(OpsQuant, LoraGradientsOverAQuantisedBaseMatchFiniteDifferences) {
  std::mt19937 rng(8);
  for (const DType dtype : {DType::Q4_K, DType::Q8_0}) {
    const int64_t K = kernels::quant_block_values(quant_type(dtype)), N = 7, M = 6, r = 2;
    const Tensor w = random_quantised(dtype, N, K, 12);
    std::vector<Tensor> inputs = {random_tensor(Shape{M, K}, rng), random_tensor(Shape{N}, rng),
                                  random_tensor(Shape{r, K}, rng, 0.2f),
                                  random_tensor(Shape{N, r}, rng)};
    const Tensor proj = random_tensor(Shape{M, N}, rng);
    const auto forward = [&](const std::vector<Variable>& v) {
      return lora_linear(v[0], Variable(w, false), v[1], v[2], v[3], 0.75f);
    };
    const auto objective = [&] {
      NoGradGuard no_grad;
      std::vector<Variable> v;
      for (const Tensor& t : inputs) v.emplace_back(t, false);
      const Tensor y = forward(v).value();
      double sum = 0.0;
      for (int64_t i = 0; i < y.numel(); ++i)
        sum += static_cast<double>(y.f32()[i]) * static_cast<double>(proj.f32()[i]);
      return sum;
    };
    std::vector<Variable> vars;
    for (const Tensor& t : inputs) vars.emplace_back(t, true);
    backward(forward(vars), proj);
    for (size_t which = 0; which < inputs.size(); ++which) {
      const Tensor& g = vars[which].grad();
      ASSERT_TRUE(g.defined());
      double size = 1e-6;
      for (int64_t i = 0; i < g.numel(); ++i)
        size = std::max(size, std::abs(static_cast<double>(g.f32()[i])));
      std::uniform_int_distribution<int64_t> pick(0, inputs[which].numel() - 1);
      for (int s = 0; s < 24; ++s) {
        float& e = inputs[which].f32()[pick(rng)];
        const int64_t i = &e - inputs[which].f32();
        const float saved = e;
        const float h = 1e-2f;
        e = saved + h;
        const double up = objective();
        e = saved - h;
        const double down = objective();
        e = saved;
        EXPECT_NEAR(g.f32()[i], (up - down) / (2.0 * h), 2e-3 * size)
            << dtype_name(dtype) << " input " << which << " element " << i;
      }
    }
  }
}

// A mixture's experts quantised with each expert's gate and up rows in one tensor (a GGUF file's
// ffn_gate_up_exps, read in place) compute bitwise as the two tensors of the same blocks apart:
// the output and x's and the adapters' gradients, in FP32 and bf16 compute, on one thread and
// three; and as the dequantised fused tensor within rounding.
TEST(OpsQuant, ExpertsGateAndUpInOneQuantisedAreTheTwo) {
  std::mt19937 rng(12);
  for (const DType dtype : {DType::Q8_0, DType::Q4_K}) {
    const int64_t N = 24, C = 256, F = 40, E = 4, k = 2, r = 2;
    const Tensor flat = random_quantised(dtype, E * 2 * F, C, 13);
    const Tensor w13 = Tensor::empty(Shape{E, 2 * F, C}, dtype, MemoryCategory::Workspace);
    std::memcpy(w13.raw(), flat.raw(), flat.bytes());
    const size_t row = flat.bytes() / static_cast<size_t>(E * 2 * F);
    Tensor half[2];
    for (int h = 0; h < 2; ++h) {
      half[h] = Tensor::empty(Shape{E, F, C}, dtype, MemoryCategory::Workspace);
      for (int64_t e = 0; e < E; ++e)
        std::memcpy(
            static_cast<uint8_t*>(half[h].raw()) + static_cast<size_t>(e * F) * row,
            static_cast<const uint8_t*>(w13.raw()) + static_cast<size_t>((2 * e + h) * F) * row,
            static_cast<size_t>(F) * row);
    }
    Tensor w13d = Tensor::empty(Shape{E, 2 * F, C}, DType::F32, MemoryCategory::Workspace);
    kernels::dequantize_rows(flat.quant(), 0, E * 2 * F, w13d.f32());
    const Tensor x = random_tensor(Shape{1, N, C}, rng), dy = random_tensor(Shape{1, N, C}, rng),
                 logits = random_tensor(Shape{1, N, E}, rng),
                 w2 = random_tensor(Shape{E, C, F}, rng, 0.1f),
                 a = random_tensor(Shape{E, r, C}, rng, 0.1f),
                 b1 = random_tensor(Shape{E, F, r}, rng, 0.1f),
                 b3 = random_tensor(Shape{E, F, r}, rng, 0.1f);
    struct Run {
      Tensor y, dx, da, db1, db3;
    };
    const auto run = [&](const Tensor& w1, const Tensor& w3, int threads, DType compute) {
      const int previous = omp_get_max_threads();
      omp_set_num_threads(threads);
      ComputeDTypeGuard precision(compute);
      Variable vx(x, true), va(a, true), vb1(b1, true), vb3(b3, true);
      const MoeRouting route =
          moe_route(Variable(logits, false), k, kernels::MoeGating::Softmax, true);
      const Variable y = moe_experts(
          vx, Variable(w1, false), w3.defined() ? Variable(w3, false) : Variable(),
          Variable(w2, false), route, MoeAdapters{va, vb1, va, vb3, Variable(), Variable(), 0.5f});
      backward(y, dy);
      omp_set_num_threads(previous);
      return Run{y.value(), vx.grad(), va.grad(), vb1.grad(), vb3.grad()};
    };
    for (const DType compute : {DType::F32, DType::BF16})
      for (const int threads : {1, 3}) {
        const std::string what = std::string(dtype_name(dtype)) + " " +
                                 std::string(dtype_name(compute)) + " " + std::to_string(threads) +
                                 " threads";
        const Run fused = run(w13, Tensor(), threads, compute),
                  apart = run(half[0], half[1], threads, compute);
        const Tensor* got[] = {&fused.y, &fused.dx, &fused.da, &fused.db1, &fused.db3};
        const Tensor* want[] = {&apart.y, &apart.dx, &apart.da, &apart.db1, &apart.db3};
        for (size_t j = 0; j < 5; ++j)
          for (int64_t i = 0; i < want[j]->numel(); ++i)
            ASSERT_EQ(got[j]->f32()[i], want[j]->f32()[i]) << what << ", result " << j << " " << i;
        if (compute == DType::F32) {
          const Run values = run(w13d, Tensor(), threads, compute);
          EXPECT_LT(relative_difference(fused.y, values.y), 1e-5) << what;
          EXPECT_LT(relative_difference(fused.dx, values.dx), 1e-5) << what;
        }
      }
  }
}

}  // namespace
}  // namespace cputrain
