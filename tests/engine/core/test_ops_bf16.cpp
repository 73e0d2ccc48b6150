// The ops under ComputeDTypeGuard(BF16). On inputs and output gradients that are already bf16
// values, rounding changes nothing, so every op must give what it gives in FP32: exactly for
// the ops whose arithmetic stays FP32, up to summation order for the GEMMs. On arbitrary
// inputs the results must stay within bf16 rounding of FP32, and what the ops save for backward
// must be bf16.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>
#include <vector>

#include "engine/core/memory.h"
#include "engine/core/ops.h"
#include "kernels/attention/attention.h"
#include "kernels/cpu/bf16.h"
#include "kernels/gemm/gemm.h"
#include "kernels/gemm/gemm_test_hooks.h"
#include "kernels/ops/rope.h"

namespace cputrain {
namespace {

using OpFn = std::function<Variable(const std::vector<Variable>&)>;

Tensor random_tensor(const Shape& shape, std::mt19937& rng, bool bf16_values, float scale = 1.0f) {
  Tensor t = Tensor::empty(shape, DType::F32, MemoryCategory::Workspace);
  std::normal_distribution<float> dist(0.0f, scale);
  for (int64_t i = 0; i < t.numel(); ++i) {
    const float x = dist(rng);
    t.f32()[i] = bf16_values ? kernels::bf16_to_fp32(kernels::fp32_to_bf16(x)) : x;
  }
  return t;
}

struct ModeRun {
  std::vector<float> out;
  std::vector<std::vector<float>> grads;
};

// A tensor's values as floats (bf16 widened).
std::vector<float> values(const Tensor& t) {
  if (t.dtype() == DType::F32) return {t.f32(), t.f32() + t.numel()};
  std::vector<float> out(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) out[i] = kernels::bf16_to_fp32(t.bf16()[i]);
  return out;
}

// The op's output and the gradients of all inputs for output gradient r, under `dtype`. The
// inputs enter through an op (a residual add of zeros), as activations do in a model.
ModeRun run(const OpFn& op, const std::vector<Tensor>& inputs, const Tensor& r, DType dtype) {
  ComputeDTypeGuard precision(dtype);
  std::vector<Variable> leaves, vars;
  for (const Tensor& t : inputs) {
    leaves.emplace_back(t, true);
    vars.push_back(
        add(leaves.back(),
            Variable(Tensor::zeros(t.shape(), DType::F32, MemoryCategory::Workspace), false)));
  }
  const Variable out = op(vars);
  ModeRun result{values(out.value()), {}};
  backward(out, r);
  for (const Variable& v : leaves) result.grads.push_back(values(v.grad()));
  return result;
}

double max_abs(const std::vector<float>& v) {
  double m = 1e-30;
  for (float x : v) m = std::max(m, static_cast<double>(std::abs(x)));
  return m;
}

// Every element of got within rel * max|want| of want.
void expect_close(const std::vector<float>& got, const std::vector<float>& want, double rel,
                  const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  const double tol = rel * max_abs(want);
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], want[i], tol) << what << " element " << i;
}

void compare_modes(const OpFn& op, const std::vector<Tensor>& inputs, const Shape& out_shape,
                   double rel, double grad_rel) {
  std::mt19937 rng(99);
  const Tensor r = random_tensor(out_shape, rng, true);
  const ModeRun f32 = run(op, inputs, r, DType::F32);
  const ModeRun bf16 = run(op, inputs, r, DType::BF16);
  expect_close(bf16.out, f32.out, rel, "output");
  for (size_t i = 0; i < inputs.size(); ++i)
    expect_close(bf16.grads[i], f32.grads[i], grad_rel, "grad");
}

// An op whose bf16-mode output is only ever a GEMM's or attention's input: there it is the bf16
// rounding of the FP32 output and nothing else (an op on FP32 values refuses it); the gradients
// are those of FP32.
void expect_rounded_output_and_fp32_gradients(const OpFn& op, const std::vector<Tensor>& inputs,
                                              const Shape& out_shape) {
  std::mt19937 rng(98);
  const Tensor r = random_tensor(out_shape, rng, true);
  const ModeRun f32 = run(op, inputs, r, DType::F32);
  const ModeRun bf16 = run(op, inputs, r, DType::BF16);
  ASSERT_EQ(bf16.out.size(), f32.out.size());
  for (size_t i = 0; i < f32.out.size(); ++i)
    ASSERT_EQ(bf16.out[i], kernels::bf16_to_fp32(kernels::fp32_to_bf16(f32.out[i]))) << i;
  for (size_t i = 0; i < inputs.size(); ++i) EXPECT_EQ(bf16.grads[i], f32.grads[i]);
  ComputeDTypeGuard precision(DType::BF16);
  std::vector<Variable> vars;
  for (const Tensor& t : inputs) vars.emplace_back(t, false);
  const Variable y = op(vars);
  EXPECT_EQ(y.value().dtype(), DType::BF16);
  EXPECT_THROW(add(y, y), std::invalid_argument);
  // Its rounding feeds a GEMM as is.
  const int64_t K = out_shape[out_shape.ndim() - 1];
  const Variable w(random_tensor(Shape{7, K}, rng, true), false);
  EXPECT_EQ(linear(y, w).value().numel(), y.value().numel() / K * 7);
}

TEST(OpsBf16, LinearOnBf16ValuesMatchesFp32) {
  std::mt19937 rng(1);
  compare_modes(
      [](const auto& v) { return linear(v[0], v[1]); },
      {random_tensor(Shape{3, 17, 33}, rng, true), random_tensor(Shape{19, 33}, rng, true)},
      Shape{3, 17, 19}, 1e-6, 1e-6);
}

TEST(OpsBf16, RmsNormOnBf16ValuesMatchesFp32) {
  std::mt19937 rng(2);
  expect_rounded_output_and_fp32_gradients(
      [](const auto& v) { return rmsnorm(v[0], v[1], 1e-5f); },
      {random_tensor(Shape{5, 7, 24}, rng, true), random_tensor(Shape{24}, rng, true)},
      Shape{5, 7, 24});
}

// The output is exact (within bf16 rounding where the probabilities are rounded); the backward
// sees the output rounded to bf16 (it is saved that way), so the gradients are within bf16
// rounding.
TEST(OpsBf16, AttentionOnBf16ValuesMatchesFp32) {
  std::mt19937 rng(3);
  const Shape s{2, 9, 12};
  // Where attention has bf16 products it also rounds the probabilities (2^-9 relative).
  compare_modes(
      [](const auto& v) { return attention(v[0], v[1], v[2], 3, 3); },
      {random_tensor(s, rng, true), random_tensor(s, rng, true), random_tensor(s, rng, true)}, s,
      kernels::attention_bf16_native() ? 4e-3 : 0.0, 1e-2);
  // Grouped-query: 4 query heads on 2 key/value heads.
  const Shape q{2, 9, 16}, kv{2, 9, 8};
  compare_modes(
      [](const auto& v) { return attention(v[0], v[1], v[2], 4, 2); },
      {random_tensor(q, rng, true), random_tensor(kv, rng, true), random_tensor(kv, rng, true)}, q,
      kernels::attention_bf16_native() ? 4e-3 : 0.0, 1e-2);
}

// With options (a scale, a cap, a window), as without: where attention has bf16 products the
// output within their rounding of the probabilities, else exactly what fp32 mode gives on the
// bf16 values; the gradients within bf16 rounding (the backward sees the output as saved,
// rounded to bf16).
TEST(OpsBf16, AttentionWithOptionsOnBf16ValuesMatchesFp32) {
  std::mt19937 rng(43);
  const Shape q{2, 70, 16}, kv{2, 70, 8};
  compare_modes(
      [](const auto& v) {
        return attention(v[0], v[1], v[2], 4, 2, nullptr,
                         kernels::AttentionOptions{0.3f, 5.0f, 65});
      },
      {random_tensor(q, rng, true), random_tensor(kv, rng, true), random_tensor(kv, rng, true)}, q,
      kernels::attention_bf16_native() ? 4e-3 : 0.0, 1e-2);
}

TEST(OpsBf16, SwiGluOnBf16ValuesMatchesFp32) {
  std::mt19937 rng(4);
  const Shape s{3, 5, 11};
  expect_rounded_output_and_fp32_gradients(
      [](const auto& v) { return swiglu(v[0], v[1]); },
      {random_tensor(s, rng, true), random_tensor(s, rng, true)}, s);
}

TEST(OpsBf16, GatedAndPlainGeluOnBf16ValuesMatchFp32) {
  std::mt19937 rng(41);
  const Shape s{3, 5, 11};
  expect_rounded_output_and_fp32_gradients(
      [](const auto& v) { return geglu(v[0], v[1]); },
      {random_tensor(s, rng, true), random_tensor(s, rng, true)}, s);
  expect_rounded_output_and_fp32_gradients([](const auto& v) { return gelu(v[0]); },
                                           {random_tensor(s, rng, true)}, s);
}

TEST(OpsBf16, NormsPlusOneAndLayerNormOnBf16ValuesMatchFp32) {
  std::mt19937 rng(42);
  expect_rounded_output_and_fp32_gradients(
      [](const auto& v) { return rmsnorm(v[0], v[1], 1e-5f, 1.0f); },
      {random_tensor(Shape{5, 7, 24}, rng, true), random_tensor(Shape{24}, rng, true)},
      Shape{5, 7, 24});
  expect_rounded_output_and_fp32_gradients(
      [](const auto& v) { return layernorm(v[0], v[1], v[2], 1e-5f); },
      {random_tensor(Shape{5, 7, 24}, rng, true), random_tensor(Shape{24}, rng, true),
       random_tensor(Shape{24}, rng, true)},
      Shape{5, 7, 24});
}

TEST(OpsBf16, RopeOnBf16ValuesMatchesFp32) {
  std::mt19937 rng(5);
  const Shape s{2, 7, 12};
  Tensor table = Tensor::empty(Shape{7, 4}, DType::F32, MemoryCategory::Workspace);
  kernels::rope_table(table.f32(), 7, 4, 10000.0);
  expect_rounded_output_and_fp32_gradients(
      [table](const auto& v) { return rope(v[0], table, 3, false); }, {random_tensor(s, rng, true)},
      s);
  expect_rounded_output_and_fp32_gradients(
      [table](const auto& v) { return rope(v[0], table, 3, true); }, {random_tensor(s, rng, true)},
      s);
}

// In bf16 mode the fused LM head and loss round what linear then cross_entropy round (the
// input, the weight, the gradient by the logits): the same loss and gradients up to summation
// order, for any chunk size and an output gradient that is not 1.
TEST(OpsBf16, LmHeadCrossEntropyMatchesLinearThenCrossEntropy) {
  std::mt19937 rng(21);
  const std::vector<Tensor> inputs = {random_tensor(Shape{2, 9, 16}, rng, false),
                                      random_tensor(Shape{37, 16}, rng, false)};
  Tensor targets = Tensor::empty(Shape{18}, DType::I32, MemoryCategory::Workspace);
  for (int i = 0; i < 18; ++i) targets.i32()[i] = (i * 11 + 4) % 37;
  Tensor r = Tensor::empty(Shape{1}, DType::F32, MemoryCategory::Workspace);
  r.f32()[0] = 0.5f;
  const ModeRun want =
      run([&](const auto& v) { return cross_entropy(linear(v[0], v[1]), targets); }, inputs, r,
          DType::BF16);
  for (int64_t chunk : {0, 1, 5, 18}) {
    const ModeRun got =
        run([&](const auto& v) { return lm_head_cross_entropy(v[0], v[1], targets, chunk); },
            inputs, r, DType::BF16);
    expect_close(got.out, want.out, 1e-6, "loss");
    expect_close(got.grads[0], want.grads[0], 1e-5, "dx");
    expect_close(got.grads[1], want.grads[1], 1e-5, "dw");
  }
}

TEST(OpsBf16, ArbitraryInputsStayWithinBf16RoundingOfFp32) {
  // A block-like chain: norm, projections, attention, SwiGLU, residual. Each rounding is a
  // relative 2^-9; a few of them in series stay within about 2%.
  std::mt19937 rng(5);
  const int64_t C = 32, F = 48, H = 4;
  auto block = [=](const std::vector<Variable>& v) {
    Variable h = rmsnorm(v[0], v[1], 1e-5f);
    Variable a =
        add(v[0], linear(attention(linear(h, v[2]), linear(h, v[3]), linear(h, v[4]), H, H), v[5]));
    return add(a, linear(swiglu(linear(a, v[6]), linear(a, v[7])), v[8]));
  };
  std::vector<Tensor> inputs = {random_tensor(Shape{2, 13, C}, rng, false),
                                random_tensor(Shape{C}, rng, false)};
  for (int i = 0; i < 4; ++i) inputs.push_back(random_tensor(Shape{C, C}, rng, false, 0.2f));
  inputs.push_back(random_tensor(Shape{F, C}, rng, false, 0.2f));
  inputs.push_back(random_tensor(Shape{F, C}, rng, false, 0.2f));
  inputs.push_back(random_tensor(Shape{C, F}, rng, false, 0.2f));
  const Tensor r = random_tensor(Shape{2, 13, C}, rng, false);
  const ModeRun f32 = run(block, inputs, r, DType::F32);
  const ModeRun bf16 = run(block, inputs, r, DType::BF16);
  auto rel_l2 = [](const std::vector<float>& a, const std::vector<float>& b) {
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < a.size(); ++i) {
      num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
      den += static_cast<double>(b[i]) * b[i];
    }
    return std::sqrt(num / den);
  };
  const double out_error = rel_l2(bf16.out, f32.out);
  EXPECT_LT(out_error, 0.02);
  EXPECT_GT(out_error, 0.0);  // the bf16 path did round
  for (size_t i = 0; i < inputs.size(); ++i)
    EXPECT_LT(rel_l2(bf16.grads[i], f32.grads[i]), 0.02) << i;
}

// Activation bytes the tape of `op` holds once its inputs and output are dropped: what the op
// saved for backward. The inputs are made by an op, as activations are in a model.
int64_t saved_activation_bytes(const OpFn& op, const std::vector<Tensor>& inputs, DType dtype) {
  const auto live = [] {
    return memory_stats().live_bytes[static_cast<int>(MemoryCategory::Activations)];
  };
  const int64_t before = live();
  {
    ComputeDTypeGuard precision(dtype);
    std::vector<Variable> vars;
    for (const Tensor& t : inputs) {
      Variable leaf(t, true);
      vars.push_back(add(leaf, leaf));
    }
    op(vars);
  }
  const int64_t held = live() - before;
  clear_tape();
  return held;
}

// In bf16 mode the gradient of a linear layer's output, when its only contribution comes from
// swiglu, rope or add, is written as its bf16 rounding alone (all the layer's backward reads);
// with a second contribution counted it stays FP32 and the layer rounds it. Either way every
// parameter gradient has the same bits.
TEST(OpsBf16, LinearOutputGradientsRoundedWhereProducedSameBits) {
  std::mt19937 rng(7);
  const int64_t B = 2, T = 5, C = 8, F = 12, H = 2;
  Tensor table = Tensor::empty(Shape{T, C / H / 2, 2}, DType::F32, MemoryCategory::Workspace);
  kernels::rope_table(table.f32(), T, C / H, 10000.0);
  const Tensor x0 = random_tensor(Shape{B, T, C}, rng, false);
  std::vector<Tensor> w;
  for (const Shape& s : {Shape{F, C}, Shape{F, C}, Shape{C, F}, Shape{C, C}, Shape{C, C}})
    w.push_back(random_tensor(s, rng, false, 0.3f));
  const Tensor r = random_tensor(Shape{B, T, C}, rng, false);
  auto step = [&](bool extra_contribution, std::vector<DType>* grad_dtypes) {
    ComputeDTypeGuard precision(DType::BF16);
    Variable x(x0, true);
    std::vector<Variable> ws;
    for (const Tensor& t : w) ws.emplace_back(t, true);
    const Variable h =
        add(x, Variable(Tensor::zeros(x0.shape(), DType::F32, MemoryCategory::Workspace), false));
    const Variable g = linear(h, ws[0]), u = linear(h, ws[1]);
    const Variable o = linear(swiglu(g, u), ws[2]);
    const Variable y = linear(h, ws[3]);
    const Variable l4 = linear(rope(y, table, H, false), ws[4]);
    const Variable out = add(add(h, o), l4);
    // One more contribution counted for each, none made: the rounding moves to the layers.
    if (extra_contribution)
      for (const Variable* v : {&g, &u, &o, &y, &l4}) needs_grad({v});
    backward(out, r);
    for (const Variable* v : {&g, &u, &o, &y, &l4}) grad_dtypes->push_back(v->grad().dtype());
    std::vector<std::vector<float>> grads{values(x.grad())};
    for (const Variable& v : ws) grads.push_back(values(v.grad()));
    return grads;
  };
  std::vector<DType> rounded, unrounded;
  const auto a = step(false, &rounded), b = step(true, &unrounded);
  for (DType d : rounded) EXPECT_EQ(d, DType::BF16);
  for (DType d : unrounded) EXPECT_EQ(d, DType::F32);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], b[i]) << "gradient " << i;
}

// lora_linear in bf16 mode: y = x W' + (s u) B' and dX = dY W + (s g) A each as one product that
// adds the update inside it (kernels::gemm_bf16_low_rank), with the bits of the two products one
// after the other: the output and every gradient (x, W, the bias, A, B) the same with the update
// inside the product and outside it, over a frozen W and a trained one; and within bf16
// rounding of FP32 mode.
TEST(OpsBf16, LoraLinearInOneProductGivesTheTwoProductsBits) {
  std::mt19937 rng(13);
  const int64_t M = 80, N = 100, K = 72, r = 16;
  if (!kernels::gemm_bf16_low_rank_fused(kernels::Transpose::No, kernels::Transpose::Yes, M, N, K,
                                         r) ||
      !kernels::gemm_bf16_low_rank_fused(kernels::Transpose::No, kernels::Transpose::No, M, K, N,
                                         r))
    GTEST_SKIP() << "the selected GEMM runs the update as a second product";
  struct Restore {
    ~Restore() { kernels::gemm_set_low_rank(true); }
  } restore;
  const std::vector<Tensor> inputs = {
      random_tensor(Shape{2, M / 2, K}, rng, false), random_tensor(Shape{N, K}, rng, false, 0.3f),
      random_tensor(Shape{N}, rng, false), random_tensor(Shape{r, K}, rng, false, 0.3f),
      random_tensor(Shape{N, r}, rng, false, 0.3f)};
  const Tensor out_grad = random_tensor(Shape{2, M / 2, N}, rng, false);
  const OpFn op = [](const auto& v) { return lora_linear(v[0], v[1], v[2], v[3], v[4], 0.75f); };
  for (const bool w_trains : {false, true}) {
    ModeRun runs[2];
    for (const bool inside : {false, true}) {
      kernels::gemm_set_low_rank(inside);
      ComputeDTypeGuard precision(DType::BF16);
      std::vector<Variable> leaves, vars;
      for (size_t i = 0; i < inputs.size(); ++i) {
        leaves.emplace_back(inputs[i], i != 1 || w_trains);
        vars.push_back(
            i == 1 ? leaves.back()
                   : add(leaves.back(), Variable(Tensor::zeros(inputs[i].shape(), DType::F32,
                                                               MemoryCategory::Workspace),
                                                 false)));
      }
      const Variable out = op(vars);
      runs[inside].out = values(out.value());
      backward(out, out_grad);
      for (size_t i = 0; i < leaves.size(); ++i)
        if (i != 1 || w_trains) runs[inside].grads.push_back(values(leaves[i].grad()));
    }
    EXPECT_EQ(runs[0].out, runs[1].out) << "W trains: " << w_trains;
    ASSERT_EQ(runs[0].grads.size(), runs[1].grads.size());
    for (size_t i = 0; i < runs[0].grads.size(); ++i)
      EXPECT_EQ(runs[0].grads[i], runs[1].grads[i])
          << "gradient " << i << ", W trains " << w_trains;
  }
  compare_modes(op, inputs, Shape{2, M / 2, N}, 2e-2, 2e-2);
}

// The LM head's chunks in bf16 mode read one packing of W^T kept for all of them
// (kernels::gemm_bf16_kept): the loss (or log-probabilities), its gradients by x, W and the bias,
// the same bits as with each chunk packing W itself; over chunks that leave a short last one,
// with a bias and a soft cap, for the mean loss and for lm_head_log_probs.
TEST(OpsBf16, LmHeadKeptWeightGivesEachChunksBits) {
  std::mt19937 rng(29);
  const int64_t N = 2 * 23, V = 300, K = 40, chunk = 10;
  if (kernels::gemm_bf16_kept_b_bytes(V, K) == 0 ||
      !kernels::gemm_bf16_keeps_b(kernels::Transpose::Yes, chunk, V, K))
    GTEST_SKIP() << "the selected GEMM keeps no packed B";
  struct Restore {
    ~Restore() { kernels::gemm_set_kept_b(true); }
  } restore;
  const std::vector<Tensor> inputs = {random_tensor(Shape{2, N / 2, K}, rng, false),
                                      random_tensor(Shape{V, K}, rng, false, 0.3f),
                                      random_tensor(Shape{V}, rng, false)};
  Tensor targets = Tensor::empty(Shape{N}, DType::I32, MemoryCategory::Workspace);
  for (int64_t i = 0; i < N; ++i) targets.i32()[i] = static_cast<int32_t>((i * 37 + 5) % V);
  targets.i32()[7] = -1;
  for (const bool per_row : {false, true})
    for (const float softcap : {0.0f, 4.0f}) {
      const Tensor r = random_tensor(Shape{per_row ? N : 1}, rng, false);
      const OpFn op = [&](const auto& v) {
        return per_row ? lm_head_log_probs(v[0], v[1], targets, chunk, v[2], softcap)
                       : lm_head_cross_entropy(v[0], v[1], targets, chunk, 0, v[2], softcap);
      };
      ModeRun runs[2];
      for (const bool kept : {false, true}) {
        kernels::gemm_set_kept_b(kept);
        runs[kept] = run(op, inputs, r, DType::BF16);
      }
      EXPECT_EQ(runs[0].out, runs[1].out) << "per row " << per_row << ", cap " << softcap;
      ASSERT_EQ(runs[0].grads.size(), 3u);
      for (size_t i = 0; i < runs[0].grads.size(); ++i)
        EXPECT_EQ(runs[0].grads[i], runs[1].grads[i])
            << "gradient " << i << ", per row " << per_row << ", cap " << softcap;
    }
}

// linear_rounded: in bf16 mode its value is linear's rounded (bf16 only, refused by ops on FP32
// values) and the gradients are linear's; in fp32 mode it is linear. Over a K within the GEMM's
// one block and one past it (where it rounds through a scratch).
TEST(OpsBf16, LinearRoundedIsLinearsRounding) {
  std::mt19937 rng(11);
  for (const int64_t K : {int64_t{40}, int64_t{600}}) {
    const Tensor x0 = random_tensor(Shape{3, 7, K}, rng, false);
    const Tensor w0 = random_tensor(Shape{9, K}, rng, false, 0.2f);
    const Tensor r = random_tensor(Shape{3, 7, 9}, rng, false);
    for (DType dtype : {DType::BF16, DType::F32}) {
      auto run = [&](bool rounded, std::vector<float>* out) {
        ComputeDTypeGuard precision(dtype);
        Variable x(x0, true), w(w0, true);
        const Variable h = add(
            x, Variable(Tensor::zeros(x0.shape(), DType::F32, MemoryCategory::Workspace), false));
        const Variable y = rounded ? linear_rounded(h, w) : linear(h, w);
        *out = values(y.value());
        EXPECT_EQ(y.value().dtype(), rounded && dtype == DType::BF16 ? DType::BF16 : DType::F32);
        if (y.value().dtype() == DType::BF16) {
          EXPECT_THROW(add(y, y), std::invalid_argument);
        }
        backward(y, r);
        return std::vector<std::vector<float>>{values(x.grad()), values(w.grad())};
      };
      std::vector<float> plain, rounded;
      const auto g_plain = run(false, &plain), g_rounded = run(true, &rounded);
      ASSERT_EQ(plain.size(), rounded.size());
      for (size_t i = 0; i < plain.size(); ++i)
        ASSERT_EQ(rounded[i], dtype == DType::BF16
                                  ? kernels::bf16_to_fp32(kernels::fp32_to_bf16(plain[i]))
                                  : plain[i])
            << "K " << K << " element " << i;
      EXPECT_EQ(g_rounded, g_plain) << "K " << K;
    }
  }
}

// add_rmsnorm is add then rmsnorm bit for bit: the sum, the norm and every gradient, in FP32
// and bf16, with and without Gemma's offset, over rows of no vector width's multiple; the sum
// read again after the norm's reader or by the norm alone, one side a linear layer's output
// (whose gradient bf16 mode writes as its rounding), or the two sides one variable.
TEST(OpsBf16, AddRmsNormIsAddThenRmsNormBitForBit) {
  std::mt19937 rng(21);
  const int64_t B = 3, T = 5;
  for (const int64_t C : {int64_t{37}, int64_t{200}}) {
    const Tensor x0 = random_tensor(Shape{B, T, C}, rng, false);
    const Tensor y0 = random_tensor(Shape{B, T, C}, rng, false);
    const Tensor g0 = random_tensor(Shape{C}, rng, false);
    const Tensor wb0 = random_tensor(Shape{C, C}, rng, false, 0.2f);
    const Tensor wm0 = random_tensor(Shape{C, C}, rng, false, 0.2f);
    const Tensor r = random_tensor(Shape{B, T, C}, rng, false);
    for (const float offset : {0.0f, 1.0f})
      for (const DType dtype : {DType::F32, DType::BF16})
        for (const int reading : {0, 1, 2}) {  // the sum read again; the norm alone; b = a
          const auto run = [&](bool fused) {
            ComputeDTypeGuard precision(dtype);
            Variable x(x0, true), y(y0, true), g(g0, true), wb(wb0, true), wm(wm0, true);
            const Tensor zeros = Tensor::zeros(x0.shape(), DType::F32, MemoryCategory::Workspace);
            const Variable a = add(x, Variable(zeros, false));
            const Variable b = reading == 2 ? a : linear(add(y, Variable(zeros, false)), wb);
            Variable sum, normed;
            if (fused) {
              SumAndNorm both = add_rmsnorm(a, b, g, 1e-5f, offset);
              sum = both.sum;
              normed = both.normed;
            } else {
              sum = add(a, b);
              normed = rmsnorm(sum, g, 1e-5f, offset);
            }
            const Variable m = linear(normed, wm);
            std::vector<std::vector<float>> got{values(sum.value()), values(normed.value())};
            backward(reading == 1 ? m : add(sum, m), r);
            for (const Variable* v : {&x, &y, &g, &wb, &wm})
              got.push_back(v->requires_grad() && v->grad().defined() ? values(v->grad())
                                                                      : std::vector<float>());
            return got;
          };
          const auto fused = run(true), apart = run(false);
          ASSERT_EQ(fused.size(), apart.size());
          for (size_t i = 0; i < fused.size(); ++i)
            EXPECT_EQ(fused[i], apart[i])
                << "C " << C << " offset " << offset << " bf16 " << (dtype == DType::BF16)
                << " reading " << reading << " tensor " << i;
        }
  }
}

TEST(OpsBf16, SavedActivationsAreBf16) {
  std::mt19937 rng(6);
  const int64_t B = 2, T = 16, H = 4, C = 32, E = B * T * C;
  const Shape s{B, T, C};
  const std::vector<Tensor> in = {random_tensor(s, rng, false), random_tensor(s, rng, false),
                                  random_tensor(s, rng, false)};
  // swiglu saves gate and up.
  const OpFn swiglu_op = [](const auto& v) { return swiglu(v[0], v[1]); };
  EXPECT_EQ(saved_activation_bytes(swiglu_op, {in[0], in[1]}, DType::F32), 2 * E * 4);
  EXPECT_EQ(saved_activation_bytes(swiglu_op, {in[0], in[1]}, DType::BF16), 2 * E * 2);
  // attention saves q, k, v, its output, and the FP32 log-sum-exp per (b, h, t).
  const OpFn attention_op = [H](const auto& v) { return attention(v[0], v[1], v[2], H, H); };
  EXPECT_EQ(saved_activation_bytes(attention_op, in, DType::F32), 4 * E * 4 + B * H * T * 4);
  EXPECT_EQ(saved_activation_bytes(attention_op, in, DType::BF16), 4 * E * 2 + B * H * T * 4);
  // rmsnorm saves its input and the FP32 reciprocal norm per row.
  const OpFn norm_op = [](const auto& v) { return rmsnorm(v[0], v[1], 1e-5f); };
  const Tensor gain = random_tensor(Shape{C}, rng, false);
  EXPECT_EQ(saved_activation_bytes(norm_op, {in[0], gain}, DType::F32), E * 4 + B * T * 4 + C * 4);
  EXPECT_EQ(saved_activation_bytes(norm_op, {in[0], gain}, DType::BF16), E * 2 + B * T * 4 + C * 4);
}

TEST(OpsBf16, LeafWithoutCopyConvertsItsCurrentValue) {
  Tensor t = Tensor::zeros(Shape{4}, DType::F32, MemoryCategory::Workspace);
  Variable leaf(t, false);
  t.f32()[0] = 1.0f;
  EXPECT_EQ(leaf.bf16_value().bf16()[0], kernels::fp32_to_bf16(1.0f));
  t.f32()[0] = 2.0f;  // a leaf's value may change: no stale cache
  EXPECT_EQ(leaf.bf16_value().bf16()[0], kernels::fp32_to_bf16(2.0f));
}

}  // namespace
}  // namespace cputrain
