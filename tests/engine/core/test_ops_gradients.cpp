// Finite-difference checks of every differentiable op: for a random projection R of the
// output, d(sum(op(inputs) * R)) / d(input) from backward() must match central differences.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "engine/core/deltanet_ops.h"
#include "engine/core/moe_ops.h"
#include "engine/core/ops.h"
#include "kernels/ops/cross_entropy.h"
#include "kernels/ops/rope.h"

namespace cputrain {
namespace {

using OpFn = std::function<Variable(const std::vector<Variable>&)>;

Tensor random_tensor(const Shape& shape, std::mt19937& rng, float scale = 1.0f) {
  Tensor t = Tensor::empty(shape, DType::F32, MemoryCategory::Workspace);
  std::normal_distribution<float> dist(0.0f, scale);
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = dist(rng);
  return t;
}

double projected(const OpFn& op, const std::vector<Tensor>& inputs, const Tensor& r) {
  NoGradGuard no_grad;
  std::vector<Variable> vars;
  for (const Tensor& t : inputs) vars.emplace_back(t, false);
  const Tensor out = op(vars).value();
  double sum = 0.0;
  for (int64_t i = 0; i < out.numel(); ++i)
    sum += static_cast<double>(out.f32()[i]) * static_cast<double>(r.f32()[i]);
  return sum;
}

// Compares the analytic gradient of every input against central differences with step h, on
// up to `samples` elements per input. The error is measured relative to the largest gradient
// magnitude of that input, so tiny components are not judged on noise alone.
void check_gradients(const OpFn& op, const std::vector<Tensor>& inputs, double tolerance,
                     float h = 1e-2f, int samples = 48) {
  std::mt19937 rng(7);
  std::vector<Variable> vars;
  for (const Tensor& t : inputs) vars.emplace_back(t, true);
  const Variable out = op(vars);
  const Tensor r = random_tensor(out.shape(), rng);
  backward(out, r);
  for (size_t which = 0; which < inputs.size(); ++which) {
    const Tensor& x = inputs[which];
    const Tensor& grad = vars[which].grad();
    ASSERT_TRUE(grad.defined()) << "input " << which << " received no gradient";
    double max_grad = 1e-6;
    for (int64_t i = 0; i < x.numel(); ++i)
      max_grad = std::max(max_grad, std::abs(static_cast<double>(grad.f32()[i])));
    std::uniform_int_distribution<int64_t> pick(0, x.numel() - 1);
    for (int s = 0; s < samples; ++s) {
      const int64_t i = s < x.numel() ? (x.numel() <= samples ? s : pick(rng)) : -1;
      if (i < 0) break;
      const float saved = x.f32()[i];
      x.f32()[i] = saved + h;
      const double up = projected(op, inputs, r);
      x.f32()[i] = saved - h;
      const double down = projected(op, inputs, r);
      x.f32()[i] = saved;
      const double numeric = (up - down) / (2.0 * h);
      const double analytic = grad.f32()[i];
      EXPECT_NEAR(analytic, numeric, tolerance * max_grad) << "input " << which << " element " << i;
    }
  }
}

// A gradient's first contribution may overwrite it (beta 0, uninitialised memory); later ones
// add (beta 1); get_or_zeros after that returns the same tensor.
TEST(GradCell, FirstContributionOverwritesThenAccumulates) {
  GradCell cell(Shape{3});
  float beta = -1.0f;
  const Tensor first = cell.get_for_accumulate(&beta);
  EXPECT_EQ(beta, 0.0f);
  for (int i = 0; i < 3; ++i) first.f32()[i] = static_cast<float>(i);
  const Tensor second = cell.get_for_accumulate(&beta);
  EXPECT_EQ(beta, 1.0f);
  EXPECT_EQ(second.f32(), first.f32());
  EXPECT_EQ(cell.get_or_zeros().f32(), first.f32());
  EXPECT_EQ(cell.get_or_zeros().f32()[2], 2.0f);
}

TEST(OpsGradient, Linear) {
  std::mt19937 rng(1);
  // x (2, 3, 7) and w (5, 7): odd sizes on every axis.
  check_gradients([](const auto& v) { return linear(v[0], v[1]); },
                  {random_tensor(Shape{2, 3, 7}, rng), random_tensor(Shape{5, 7}, rng)}, 2e-3);
}

TEST(OpsGradient, LinearWithBias) {
  std::mt19937 rng(11);
  for (const bool rounded : {false, true})
    check_gradients(
        [rounded](const auto& v) {
          return rounded ? linear_rounded(v[0], v[1], v[2]) : linear(v[0], v[1], v[2]);
        },
        {random_tensor(Shape{2, 3, 7}, rng), random_tensor(Shape{5, 7}, rng),
         random_tensor(Shape{5}, rng)},
        2e-3);
}

TEST(OpsGradient, RmsNorm) {
  std::mt19937 rng(2);
  check_gradients([](const auto& v) { return rmsnorm(v[0], v[1], 1e-5f); },
                  {random_tensor(Shape{3, 5, 9}, rng), random_tensor(Shape{9}, rng)}, 5e-3);
}

// Per-head RMSNorm (Qwen3's q and k norms): 4 heads of 6, one gain vector for all; and a head's
// values are those rmsnorm gives for it alone.
TEST(OpsGradient, HeadRmsNorm) {
  std::mt19937 rng(21);
  check_gradients([](const auto& v) { return head_rmsnorm(v[0], v[1], 1e-6f); },
                  {random_tensor(Shape{2, 3, 4 * 6}, rng), random_tensor(Shape{6}, rng)}, 5e-3);
  const Tensor x = random_tensor(Shape{1, 1, 12}, rng), w = random_tensor(Shape{6}, rng);
  const Tensor heads = head_rmsnorm(Variable(x, false), Variable(w, false), 1e-6f).value();
  for (int64_t h = 0; h < 2; ++h) {
    Tensor one = Tensor::empty(Shape{1, 1, 6}, DType::F32, MemoryCategory::Workspace);
    std::copy_n(x.f32() + h * 6, 6, one.f32());
    const Tensor want = rmsnorm(Variable(one, false), Variable(w, false), 1e-6f).value();
    for (int64_t i = 0; i < 6; ++i) EXPECT_EQ(heads.f32()[h * 6 + i], want.f32()[i]);
  }
}

TEST(OpsGradient, Rope) {
  std::mt19937 rng(3);
  const int64_t T = 5, H = 2, D = 6;
  Tensor table = Tensor::empty(Shape{T, D / 2, 2}, DType::F32, MemoryCategory::Workspace);
  kernels::rope_table(table.f32(), T, D, 10000.0);
  for (const bool half_split : {false, true})
    check_gradients([&](const auto& v) { return rope(v[0], table, H, half_split); },
                    {random_tensor(Shape{2, T, H * D}, rng)}, 2e-3);
  // A table of scaled frequencies (Llama 3's divisors): each pair's angle is the unscaled one
  // of its frequency divided by its factor, and the gradients hold as well.
  const float factors[D / 2] = {1.0f, 2.5f, 8.0f};
  Tensor scaled = Tensor::empty(Shape{T, D / 2, 2}, DType::F32, MemoryCategory::Workspace);
  kernels::rope_table(scaled.f32(), T, D, 10000.0, factors);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < D / 2; ++j) {
      const double angle = static_cast<double>(t) * std::pow(10000.0, -2.0 * j / D) / factors[j];
      EXPECT_EQ(scaled.f32()[(t * D / 2 + j) * 2], static_cast<float>(std::cos(angle)));
      EXPECT_EQ(scaled.f32()[(t * D / 2 + j) * 2 + 1], static_cast<float>(std::sin(angle)));
    }
  check_gradients([&](const auto& v) { return rope(v[0], scaled, H, true); },
                  {random_tensor(Shape{2, T, H * D}, rng)}, 2e-3);
  // Partial rotary (Phi-4-mini): the first 4 of each head's 6 rotate as a head of 4 would, the
  // last 2 pass; gradients hold.
  const int64_t R = 4;
  Tensor partial = Tensor::empty(Shape{T, R / 2, 2}, DType::F32, MemoryCategory::Workspace);
  kernels::rope_table(partial.f32(), T, R, 10000.0);
  const Tensor x = random_tensor(Shape{1, T, H * D}, rng);
  for (const bool half_split : {false, true}) {
    const Tensor y = rope(Variable(x, false), partial, H, half_split, false, R).value();
    Tensor heads = Tensor::empty(Shape{1, T, H * R}, DType::F32, MemoryCategory::Workspace);
    for (int64_t i = 0; i < T * H; ++i) std::copy_n(x.f32() + i * D, R, heads.f32() + i * R);
    const Tensor want = rope(Variable(heads, false), partial, H, half_split).value();
    for (int64_t i = 0; i < T * H; ++i)
      for (int64_t d = 0; d < D; ++d)
        EXPECT_EQ(y.f32()[i * D + d], d < R ? want.f32()[i * R + d] : x.f32()[i * D + d]);
    check_gradients([&](const auto& v) { return rope(v[0], partial, H, half_split, false, R); },
                    {random_tensor(Shape{2, T, H * D}, rng)}, 2e-3);
  }
}

// Each row with its own table (packed rows): row 0 from position 0, row 1 from position 2.
TEST(OpsGradient, RopePerRow) {
  std::mt19937 rng(23);
  const int64_t T = 5, H = 2, D = 6;
  Tensor full = Tensor::empty(Shape{T + 2, D / 2, 2}, DType::F32, MemoryCategory::Workspace);
  kernels::rope_table(full.f32(), T + 2, D, 10000.0);
  Tensor table = Tensor::empty(Shape{2, T, D / 2, 2}, DType::F32, MemoryCategory::Workspace);
  std::copy_n(full.f32(), T * D, table.f32());
  std::copy_n(full.f32() + 2 * D, T * D, table.f32() + T * D);
  check_gradients([&](const auto& v) { return rope(v[0], table, H, true, true); },
                  {random_tensor(Shape{2, T, H * D}, rng)}, 2e-3);
}

// Packed rows: sequences of 3, 1 and 3 positions in row 0, one of 7 in row 1; grouped heads.
TEST(OpsGradient, AttentionPacked) {
  std::mt19937 rng(24);
  const int64_t B = 2, T = 7, H = 4, KVH = 2, D = 4;
  auto packing = std::make_shared<Packing>();
  packing->lengths = {{3, 1, 3}, {7}};
  check_gradients([packing](const auto& v) { return attention(v[0], v[1], v[2], H, KVH, packing); },
                  {random_tensor(Shape{B, T, H * D}, rng), random_tensor(Shape{B, T, KVH * D}, rng),
                   random_tensor(Shape{B, T, KVH * D}, rng)},
                  5e-3);
}

// A scale of its own, soft-capping and a sliding window of 2, on packed rows (the window within
// each sequence).
TEST(OpsGradient, AttentionWithOptions) {
  std::mt19937 rng(27);
  const int64_t B = 2, T = 7, H = 4, KVH = 2, D = 4;
  auto packing = std::make_shared<Packing>();
  packing->lengths = {{3, 1, 3}, {7}};
  const kernels::AttentionOptions options{0.7f, 1.5f, 2};
  check_gradients(
      [packing, options](const auto& v) {
        return attention(v[0], v[1], v[2], H, KVH, packing, options);
      },
      {random_tensor(Shape{B, T, H * D}, rng), random_tensor(Shape{B, T, KVH * D}, rng),
       random_tensor(Shape{B, T, KVH * D}, rng)},
      5e-3);
}

// gpt-oss's sinks, a logit per query head, on packed rows with a window of 2: the sinks'
// gradient (the op's own sum) and q's, k's and v's through the kernels.
TEST(OpsGradient, AttentionWithSinks) {
  std::mt19937 rng(29);
  const int64_t B = 2, T = 7, H = 4, KVH = 2, D = 4;
  auto packing = std::make_shared<Packing>();
  packing->lengths = {{3, 1, 3}, {7}};
  for (const int64_t window : {0, 2}) {
    kernels::AttentionOptions options;
    options.window = window;
    check_gradients(
        [packing, options](const auto& v) {
          return attention(v[0], v[1], v[2], H, KVH, packing, options, v[3]);
        },
        {random_tensor(Shape{B, T, H * D}, rng), random_tensor(Shape{B, T, KVH * D}, rng),
         random_tensor(Shape{B, T, KVH * D}, rng), random_tensor(Shape{H}, rng)},
        5e-3);
  }
}

TEST(OpsGradient, AttentionSeveralHeads) {
  std::mt19937 rng(4);
  const Shape s{2, 7, 12};  // B 2, T 7, H 3, D 4
  check_gradients([](const auto& v) { return attention(v[0], v[1], v[2], 3, 3); },
                  {random_tensor(s, rng), random_tensor(s, rng), random_tensor(s, rng)}, 5e-3);
}

// Grouped-query: 4 query heads on 2 and on 1 key/value heads, whose gradients sum over the
// query heads that share them.
TEST(OpsGradient, AttentionGroupedQueryHeads) {
  std::mt19937 rng(14);
  const int64_t B = 2, T = 6, H = 4, D = 4;
  for (const int64_t KVH : {2, 1})
    check_gradients(
        [KVH](const auto& v) { return attention(v[0], v[1], v[2], H, KVH); },
        {random_tensor(Shape{B, T, H * D}, rng), random_tensor(Shape{B, T, KVH * D}, rng),
         random_tensor(Shape{B, T, KVH * D}, rng)},
        5e-3);
}

TEST(OpsGradient, AttentionOneHeadOnePosition) {
  std::mt19937 rng(5);
  const Shape s{1, 1, 8};
  check_gradients([](const auto& v) { return attention(v[0], v[1], v[2], 1, 1); },
                  {random_tensor(s, rng), random_tensor(s, rng), random_tensor(s, rng)}, 5e-3);
}

TEST(OpsGradient, SwiGlu) {
  std::mt19937 rng(6);
  check_gradients([](const auto& v) { return swiglu(v[0], v[1]); },
                  {random_tensor(Shape{3, 11}, rng, 2.0f), random_tensor(Shape{3, 11}, rng)}, 5e-3);
}

TEST(OpsGradient, GeGlu) {
  std::mt19937 rng(61);
  check_gradients([](const auto& v) { return geglu(v[0], v[1]); },
                  {random_tensor(Shape{3, 11}, rng, 2.0f), random_tensor(Shape{3, 11}, rng)}, 5e-3);
}

TEST(OpsGradient, Gelu) {
  std::mt19937 rng(62);
  check_gradients([](const auto& v) { return gelu(v[0]); },
                  {random_tensor(Shape{3, 2, 13}, rng, 3.0f)}, 5e-3);
}

// Gated DeltaNet's parts (engine/core/deltanet_ops.h).
TEST(OpsGradient, CausalConvSilu) {
  std::mt19937 rng(71);
  check_gradients([](const auto& v) { return causal_conv_silu(v[0], v[1]); },
                  {random_tensor(Shape{2, 6, 5}, rng), random_tensor(Shape{5, 4}, rng, 0.5f)},
                  5e-3);
}

TEST(OpsGradient, HeadL2Norm) {
  std::mt19937 rng(72);
  check_gradients([](const auto& v) { return head_l2norm(v[0], 3, 1e-6f); },
                  {random_tensor(Shape{2, 3, 3 * 5}, rng)}, 5e-3);
}

TEST(OpsGradient, DeltaNetDecayAndSigmoids) {
  std::mt19937 rng(73);
  check_gradients([](const auto& v) { return deltanet_decay(v[0], v[1], v[2]); },
                  {random_tensor(Shape{2, 3, 4}, rng), random_tensor(Shape{4}, rng, 0.5f),
                   random_tensor(Shape{4}, rng)},
                  5e-3);
  check_gradients([](const auto& v) { return sigmoid(v[0]); },
                  {random_tensor(Shape{3, 7}, rng, 2.0f)}, 5e-3);
  check_gradients([](const auto& v) { return sigmoid_gated(v[0], v[1]); },
                  {random_tensor(Shape{3, 7}, rng), random_tensor(Shape{3, 7}, rng, 2.0f)}, 5e-3);
}

TEST(OpsGradient, GatedHeadRmsNorm) {
  std::mt19937 rng(74);
  check_gradients([](const auto& v) { return gated_head_rmsnorm(v[0], v[1], v[2], 2, 1e-6f); },
                  {random_tensor(Shape{2, 3, 2 * 6}, rng), random_tensor(Shape{2, 3, 2 * 6}, rng),
                   random_tensor(Shape{6}, rng)},
                  5e-3);
}

// Their values, against the formulas in double: l2norm x / sqrt(sum x^2 + eps), the decay
// -exp(a_log) log(1 + exp(a + dt_bias)), the gated norm x / sqrt(mean x^2 + eps) w silu(z), the
// gate x sigmoid(g).
TEST(DeltaNetOps, ValuesAreTheFormulas) {
  std::mt19937 rng(76);
  const Tensor x = random_tensor(Shape{2, 12}, rng), z = random_tensor(Shape{2, 12}, rng);
  const Tensor w = random_tensor(Shape{6}, rng), h = random_tensor(Shape{2, 12}, rng);
  const Tensor al = random_tensor(Shape{12}, rng), dt = random_tensor(Shape{12}, rng);
  const auto sig = [](double v) { return 1.0 / (1.0 + std::exp(-v)); };
  const auto at = [](const Tensor& t, int64_t i) { return static_cast<double>(t.f32()[i]); };
  const Variable X(x, false), Z(z, false), W(w, false), G(h, false);
  const Tensor l2 = head_l2norm(X, 2, 1e-6f).value();
  const Tensor gn = gated_head_rmsnorm(X, Z, W, 2, 1e-6f).value();
  const Tensor dc = deltanet_decay(X, Variable(al, false), Variable(dt, false)).value();
  const Tensor sg = sigmoid_gated(X, G).value();
  for (int64_t head = 0; head < 4; ++head) {
    double ss = 0;
    for (int64_t i = 0; i < 6; ++i) ss += at(x, head * 6 + i) * at(x, head * 6 + i);
    for (int64_t i = 0; i < 6; ++i) {
      const int64_t e = head * 6 + i;
      EXPECT_NEAR(at(l2, e), at(x, e) / std::sqrt(ss + 1e-6), 1e-6);
      EXPECT_NEAR(at(gn, e),
                  at(x, e) / std::sqrt(ss / 6 + 1e-6) * at(w, i) * at(z, e) * sig(at(z, e)), 1e-5);
    }
  }
  for (int64_t e = 0; e < 24; ++e) {
    const int64_t c = e % 12;
    EXPECT_NEAR(at(dc, e), -std::exp(at(al, c)) * std::log1p(std::exp(at(x, e) + at(dt, c))), 1e-5);
    EXPECT_NEAR(at(sg, e), at(x, e) * sig(at(h, e)), 1e-6);
  }
}

// The delta rule as Qwen3.5's layer feeds it: L2-normalised q and k of 2 key heads, 4 value
// heads, the decay and the write strength from their projections; chunks of 4 over 9 positions.
TEST(OpsGradient, GatedDeltaRule) {
  std::mt19937 rng(75);
  check_gradients(
      [](const auto& v) {
        return gated_delta_rule(head_l2norm(v[0], 2, 1e-6f), head_l2norm(v[1], 2, 1e-6f), v[2],
                                deltanet_decay(v[3], v[4], v[5]), sigmoid(v[6]), 2, 4, 0.5f,
                                nullptr, 4);
      },
      {random_tensor(Shape{2, 9, 2 * 3}, rng), random_tensor(Shape{2, 9, 2 * 3}, rng),
       random_tensor(Shape{2, 9, 4 * 2}, rng), random_tensor(Shape{2, 9, 4}, rng),
       random_tensor(Shape{4}, rng, 0.5f), random_tensor(Shape{4}, rng),
       random_tensor(Shape{2, 9, 4}, rng)},
      5e-3);
}

// LayerNorm with a bias: the input's, the gains' and the bias's gradients.
// A mixture-of-experts block (engine/core/moe_ops.h): router logits whose order no step of the
// differences changes (the choice of experts has no gradient), E = 5 experts, k = 2 and 3, each
// gating, with and without renormalising the weights; x, the three expert tensors and the logits.
Tensor separated_logits(int64_t N, int64_t E, std::mt19937& rng) {
  Tensor t = random_tensor(Shape{N, E}, rng, 0.05f);
  std::vector<int> order(static_cast<size_t>(E));
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t e = 0; e < E; ++e) order[static_cast<size_t>(e)] = static_cast<int>(e);
    std::shuffle(order.begin(), order.end(), rng);
    for (int64_t e = 0; e < E; ++e) t.f32()[n * E + e] += 0.5f * static_cast<float>(order[e]);
  }
  return t;
}

TEST(OpsGradient, MixtureOfExperts) {
  for (const auto gating : {kernels::MoeGating::Softmax, kernels::MoeGating::SoftmaxTopK})
    for (const bool normalize : {false, true})
      for (const int64_t k : {2, 3}) {
        if (gating == kernels::MoeGating::SoftmaxTopK && normalize) continue;
        std::mt19937 rng(static_cast<uint32_t>(90 + k));
        const int64_t N = 7, C = 6, F = 5, E = 5;
        check_gradients(
            [&](const auto& v) {
              const MoeRouting route = moe_route(v[4], k, gating, normalize);
              return moe_experts(v[0], v[1], v[2], v[3], route);
            },
            {random_tensor(Shape{1, N, C}, rng), random_tensor(Shape{E, F, C}, rng, 0.5f),
             random_tensor(Shape{E, F, C}, rng, 0.5f), random_tensor(Shape{E, C, F}, rng, 0.5f),
             separated_logits(N, E, rng)},
            5e-3, 1e-3f);
      }
}

// gpt-oss's experts: top k of the logits softmaxed, biases on each expert's gate, up and down
// products and the clamped SwiGLU, the gate and up products wide enough that both clamps bite
// (central differences away from them); every input's gradient, the biases' too; with an adapter
// on each product as well.
TEST(OpsGradient, MixtureOfExpertsWithBiasesClamped) {
  for (const bool adapters : {false, true}) {
    std::mt19937 rng(101);
    const int64_t N = 7, C = 6, F = 5, E = 4, k = 2, r = 2;
    std::vector<Tensor> in = {random_tensor(Shape{1, N, C}, rng),
                              random_tensor(Shape{E, F, C}, rng, 3.0f),
                              random_tensor(Shape{E, F, C}, rng, 3.0f),
                              random_tensor(Shape{E, C, F}, rng, 0.5f),
                              separated_logits(N, E, rng),
                              random_tensor(Shape{E, F}, rng, 2.0f),
                              random_tensor(Shape{E, F}, rng, 2.0f),
                              random_tensor(Shape{E, C}, rng)};
    if (adapters)
      for (const Shape& s : {Shape{E, r, C}, Shape{E, F, r}, Shape{E, r, C}, Shape{E, F, r},
                             Shape{E, r, F}, Shape{E, C, r}})
        in.push_back(random_tensor(s, rng, 0.5f));
    SCOPED_TRACE(adapters ? "adapters" : "no adapters");
    check_gradients(
        [&](const auto& v) {
          const MoeRouting route = moe_route(v[4], k, kernels::MoeGating::SoftmaxTopK, false);
          MoeAdapters lora;
          if (adapters) lora = {v[8], v[9], v[10], v[11], v[12], v[13], 0.7f, 0.0f, 11};
          return moe_experts(v[0], v[1], v[2], v[3], route, lora, {v[5], v[6], v[7]},
                             kernels::Activation::SiluClamped);
        },
        in, 5e-3, 1e-3f);
  }
}

// Adapters on the experts' three products (A (E, r, in), B (E, out, r)), with and without
// dropout (one mask, a function of the seed): every input's gradient, the adapters' too.
TEST(OpsGradient, MixtureOfExpertsWithAdapters) {
  for (const float dropout : {0.0f, 0.3f}) {
    std::mt19937 rng(97);
    const int64_t N = 7, C = 6, F = 5, E = 4, k = 2, r = 3;
    check_gradients(
        [&](const auto& v) {
          const MoeRouting route = moe_route(v[4], k, kernels::MoeGating::Softmax, true);
          MoeAdapters lora{v[5], v[6], v[7], v[8], v[9], v[10], 0.7f, dropout, 11};
          return moe_experts(v[0], v[1], v[2], v[3], route, lora);
        },
        {random_tensor(Shape{1, N, C}, rng), random_tensor(Shape{E, F, C}, rng, 0.5f),
         random_tensor(Shape{E, F, C}, rng, 0.5f), random_tensor(Shape{E, C, F}, rng, 0.5f),
         separated_logits(N, E, rng), random_tensor(Shape{E, r, C}, rng, 0.5f),
         random_tensor(Shape{E, F, r}, rng, 0.5f), random_tensor(Shape{E, r, C}, rng, 0.5f),
         random_tensor(Shape{E, F, r}, rng, 0.5f), random_tensor(Shape{E, r, F}, rng, 0.5f),
         random_tensor(Shape{E, C, r}, rng, 0.5f)},
        5e-3, 1e-3f);
  }
}

// The adapters are their merged weights, w[e] + s b[e] a[e]: the output and x's and the
// weights' gradients equal the op's over the merged weights, and each adapter's gradients are
// the merged weight's by the chain rule (dA = s B^T dW, dB = s dW A^T); in FP32 and bf16 mode,
// on one thread and three (an expert's rows split by columns), with adapters on some products.
TEST(MoeOps, AdaptersAreTheirMergedWeights) {
  const int64_t N = 40, C = 130, F = 72, E = 6, k = 2, r = 4;
  const float s = 1.5f;
  std::mt19937 rng(98);
  const Tensor x = random_tensor(Shape{1, N, C}, rng), dy = random_tensor(Shape{1, N, C}, rng);
  Tensor logits = random_tensor(Shape{1, N, E}, rng);
  for (int64_t t = 0; t < N; ++t) logits.f32()[t * E] += 8.0f;  // expert 0's rows split
  const Shape w13{E, F, C}, w2s{E, C, F};
  const Tensor w[3] = {random_tensor(w13, rng, 0.1f), random_tensor(w13, rng, 0.1f),
                       random_tensor(w2s, rng, 0.1f)};
  const Tensor a[3] = {random_tensor(Shape{E, r, C}, rng, 0.1f),
                       random_tensor(Shape{E, r, C}, rng, 0.1f),
                       random_tensor(Shape{E, r, F}, rng, 0.1f)};
  const Tensor b[3] = {random_tensor(Shape{E, F, r}, rng, 0.1f),
                       random_tensor(Shape{E, F, r}, rng, 0.1f),
                       random_tensor(Shape{E, C, r}, rng, 0.1f)};
  // merged[j][e] = w[j][e] + s b[j][e] a[j][e]
  Tensor merged[3];
  for (int j = 0; j < 3; ++j) {
    merged[j] = Tensor::empty(w[j].shape(), DType::F32, MemoryCategory::Workspace);
    const int64_t rows = w[j].shape()[1], cols = w[j].shape()[2];
    for (int64_t e = 0; e < E; ++e)
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t c = 0; c < cols; ++c) {
          double sum = 0;
          for (int64_t q = 0; q < r; ++q)
            sum += double(b[j].f32()[(e * rows + i) * r + q]) * a[j].f32()[(e * r + q) * cols + c];
          merged[j].f32()[(e * rows + i) * cols + c] =
              w[j].f32()[(e * rows + i) * cols + c] + static_cast<float>(s * sum);
        }
  }
  for (const bool bf16 : {false, true})
    for (const int threads : {1, 3})
      for (const int which : {7, 2}) {  // adapters on all three products; on up alone
        const int previous = omp_get_max_threads();
        omp_set_num_threads(threads);
        ComputeDTypeGuard dtype(bf16 ? DType::BF16 : DType::F32);
        Variable vx(x, true), vl(logits, true), vw[3], va[3], vb[3], mx(x, true), ml(logits, true),
            mw[3];
        for (int j = 0; j < 3; ++j) {
          const bool on = (which >> j) & 1;
          vw[j] = Variable(w[j], false);
          mw[j] = Variable(on ? merged[j] : w[j], true);
          if (on) {
            va[j] = Variable(a[j], true);
            vb[j] = Variable(b[j], true);
          }
        }
        MoeAdapters lora{va[0], vb[0], va[1], vb[1], va[2], vb[2], s};
        const Variable y = moe_experts(vx, vw[0], vw[1], vw[2],
                                       moe_route(vl, k, kernels::MoeGating::Softmax, true), lora);
        backward(y, dy);
        const Variable my = moe_experts(mx, mw[0], mw[1], mw[2],
                                        moe_route(ml, k, kernels::MoeGating::Softmax, true));
        backward(my, dy);
        omp_set_num_threads(previous);
        const std::string at = std::string(bf16 ? "bf16" : "fp32") + ", " +
                               std::to_string(threads) + " threads, adapters " +
                               std::to_string(which);
        // bf16 mode rounds the merged weight once and the adapter's products apart.
        const double tol = bf16 ? 2e-2 : 1e-4;
        const auto expect_close = [&](const Tensor& got, const std::vector<double>& want,
                                      const char* what) {
          double top = 0, diff = 0;
          for (size_t i = 0; i < want.size(); ++i) {
            top = std::max(top, std::abs(want[i]));
            diff = std::max(diff, std::abs(want[i] - got.f32()[i]));
          }
          EXPECT_GT(top, 0.0) << what << ", " << at;
          EXPECT_LE(diff, tol * top) << what << ", " << at;
        };
        const auto values = [](const Tensor& t) {
          return std::vector<double>(t.f32(), t.f32() + t.numel());
        };
        expect_close(y.value(), values(my.value()), "output");
        expect_close(vx.grad(), values(mx.grad()), "x's gradient");
        expect_close(vl.grad(), values(ml.grad()), "the logits' gradient");
        for (int j = 0; j < 3; ++j) {
          if (!((which >> j) & 1)) continue;
          const Tensor& dw = mw[j].grad();
          const int64_t rows = w[j].shape()[1], cols = w[j].shape()[2];
          std::vector<double> da(static_cast<size_t>(E * r * cols)),
              db(static_cast<size_t>(E * rows * r));
          for (int64_t e = 0; e < E; ++e)
            for (int64_t i = 0; i < rows; ++i)
              for (int64_t c = 0; c < cols; ++c) {
                const double g = dw.f32()[(e * rows + i) * cols + c];
                for (int64_t q = 0; q < r; ++q) {
                  da[static_cast<size_t>((e * r + q) * cols + c)] +=
                      s * g * b[j].f32()[(e * rows + i) * r + q];
                  db[static_cast<size_t>((e * rows + i) * r + q)] +=
                      s * g * a[j].f32()[(e * r + q) * cols + c];
                }
              }
          expect_close(va[j].grad(), da, "an adapter's A");
          expect_close(vb[j].grad(), db, "an adapter's B");
        }
      }
}

// The experts' gate and up in one tensor (E, 2 F, C) (w3 undefined): every input's gradient,
// the fused tensor's and the adapters' on the gate and up parts.
TEST(OpsGradient, MixtureOfExpertsGateAndUpInOne) {
  std::mt19937 rng(103);
  const int64_t N = 7, C = 6, F = 5, E = 4, k = 2, r = 2;
  check_gradients(
      [&](const auto& v) {
        const MoeRouting route = moe_route(v[3], k, kernels::MoeGating::Softmax, true);
        MoeAdapters lora{v[4], v[5], v[4], v[6], Variable(), Variable(), 0.7f, 0.0f, 11};
        return moe_experts(v[0], v[1], Variable(), v[2], route, lora);
      },
      {random_tensor(Shape{1, N, C}, rng), random_tensor(Shape{E, 2 * F, C}, rng, 0.5f),
       random_tensor(Shape{E, C, F}, rng, 0.5f), separated_logits(N, E, rng),
       random_tensor(Shape{E, r, C}, rng, 0.5f), random_tensor(Shape{E, F, r}, rng, 0.5f),
       random_tensor(Shape{E, F, r}, rng, 0.5f)},
      5e-3, 1e-3f);
}

// The gate and up in one tensor compute as the two apart: the output and every gradient (the
// fused tensor's, each expert's gate rows then up rows, is the two gradients'), in FP32 and bf16
// mode, on one thread and three (expert 0's rows split by columns), with adapters on both parts.
TEST(MoeOps, GateAndUpInOneAreTheTwo) {
  const int64_t N = 40, C = 130, F = 72, E = 6, k = 2, r = 3;
  std::mt19937 rng(104);
  const Tensor x = random_tensor(Shape{1, N, C}, rng), dy = random_tensor(Shape{1, N, C}, rng);
  Tensor logits = random_tensor(Shape{1, N, E}, rng);
  for (int64_t t = 0; t < N; ++t) logits.f32()[t * E] += 8.0f;
  const Tensor w13 = random_tensor(Shape{E, 2 * F, C}, rng, 0.1f),
               w2 = random_tensor(Shape{E, C, F}, rng, 0.1f),
               a = random_tensor(Shape{E, r, C}, rng, 0.1f),
               b1 = random_tensor(Shape{E, F, r}, rng, 0.1f),
               b3 = random_tensor(Shape{E, F, r}, rng, 0.1f);
  Tensor half[2];
  for (int h = 0; h < 2; ++h) {
    half[h] = Tensor::empty(Shape{E, F, C}, DType::F32, MemoryCategory::Workspace);
    for (int64_t e = 0; e < E; ++e)
      std::copy_n(w13.f32() + (2 * e + h) * F * C, F * C, half[h].f32() + e * F * C);
  }
  for (const bool bf16 : {false, true})
    for (const int threads : {1, 3}) {
      const int previous = omp_get_max_threads();
      omp_set_num_threads(threads);
      ComputeDTypeGuard dtype(bf16 ? DType::BF16 : DType::F32);
      Variable fx(x, true), fl(logits, true), f13(w13, true), f2(w2, true), fa(a, true),
          fb1(b1, true), fb3(b3, true);
      Variable sx(x, true), sl(logits, true), s1(half[0], true), s3(half[1], true), s2(w2, true),
          sa(a, true), sb1(b1, true), sb3(b3, true);
      const Variable fy =
          moe_experts(fx, f13, Variable(), f2, moe_route(fl, k, kernels::MoeGating::Softmax, true),
                      MoeAdapters{fa, fb1, fa, fb3, Variable(), Variable(), 1.5f});
      backward(fy, dy);
      const Variable sy =
          moe_experts(sx, s1, s3, s2, moe_route(sl, k, kernels::MoeGating::Softmax, true),
                      MoeAdapters{sa, sb1, sa, sb3, Variable(), Variable(), 1.5f});
      backward(sy, dy);
      omp_set_num_threads(previous);
      const std::string at =
          std::string(bf16 ? "bf16" : "fp32") + ", " + std::to_string(threads) + " threads";
      const auto expect_equal = [&](const Tensor& got, const Tensor& want, const char* what) {
        ASSERT_EQ(got.numel(), want.numel()) << what;
        for (int64_t i = 0; i < want.numel(); ++i)
          ASSERT_EQ(got.f32()[i], want.f32()[i]) << what << " " << i << ", " << at;
      };
      expect_equal(fy.value(), sy.value(), "output");
      expect_equal(fx.grad(), sx.grad(), "x's gradient");
      expect_equal(fl.grad(), sl.grad(), "the logits' gradient");
      expect_equal(f2.grad(), s2.grad(), "w2's gradient");
      expect_equal(fa.grad(), sa.grad(), "the shared A's gradient");
      expect_equal(fb1.grad(), sb1.grad(), "the gate's B's gradient");
      expect_equal(fb3.grad(), sb3.grad(), "the up's B's gradient");
      for (int64_t e = 0; e < E; ++e)
        for (int h = 0; h < 2; ++h)
          for (int64_t i = 0; i < F * C; ++i)
            ASSERT_EQ(f13.grad().f32()[(2 * e + h) * F * C + i],
                      (h ? s3 : s1).grad().f32()[e * F * C + i])
                << "expert " << e << (h ? " up" : " gate") << " " << i << ", " << at;
    }
}

// A shared expert's output scaled by sigmoid of its gate, one a row.
TEST(OpsGradient, RowSigmoidGated) {
  std::mt19937 rng(94);
  check_gradients([](const auto& v) { return row_sigmoid_gated(v[0], v[1]); },
                  {random_tensor(Shape{2, 3, 7}, rng), random_tensor(Shape{2, 3, 1}, rng, 2.0f)},
                  5e-3);
}

// The block inside a checkpoint region (--checkpoint mlp): recomputed in the backward pass.
TEST(OpsGradient, MixtureOfExpertsInACheckpointRegion) {
  std::mt19937 rng(95);
  const int64_t N = 6, C = 5, F = 4, E = 4;
  check_gradients(
      [](const auto& v) {
        const Variable w1 = v[1], w3 = v[2], w2 = v[3], router = v[4];
        return checkpoint(
            [w1, w3, w2, router](const Variable& in) {
              const MoeRouting route =
                  moe_route(linear(in, router), 2, kernels::MoeGating::Softmax, true);
              return moe_experts(in, w1, w3, w2, route);
            },
            v[0]);
      },
      {random_tensor(Shape{1, N, C}, rng), random_tensor(Shape{E, F, C}, rng, 0.5f),
       random_tensor(Shape{E, F, C}, rng, 0.5f), random_tensor(Shape{E, C, F}, rng, 0.5f),
       random_tensor(Shape{E, C}, rng, 0.3f)},
      2e-2, 1e-3f);
}

// Expert e's output c for row t of x by the formulas, in double: w2[e] (silu(w1[e] x) * (w3[e] x)).
double expert_output(const Tensor& x, const Tensor& w1, const Tensor& w3, const Tensor& w2,
                     int64_t t, int64_t e, int64_t c) {
  const int64_t F = w1.shape()[1], C = w1.shape()[2];
  double out = 0;
  for (int64_t f = 0; f < F; ++f) {
    double g = 0, u = 0;
    for (int64_t i = 0; i < C; ++i) {
      g += double(w1.f32()[(e * F + f) * C + i]) * x.f32()[t * C + i];
      u += double(w3.f32()[(e * F + f) * C + i]) * x.f32()[t * C + i];
    }
    out += double(w2.f32()[(e * C + c) * F + f]) * g / (1 + std::exp(-g)) * u;
  }
  return out;
}

// Its values: each token's experts by the formulas, one at a time.
TEST(MoeOps, ValuesAreTheFormulas) {
  std::mt19937 rng(93);
  const int64_t N = 9, C = 7, F = 4, E = 6, k = 2;
  const Tensor x = random_tensor(Shape{N, C}, rng), w1 = random_tensor(Shape{E, F, C}, rng),
               w3 = random_tensor(Shape{E, F, C}, rng), w2 = random_tensor(Shape{E, C, F}, rng),
               logits = random_tensor(Shape{N, E}, rng);
  NoGradGuard no_grad;
  const MoeRouting route = moe_route(Variable(logits, false), k, kernels::MoeGating::Softmax, true);
  const Tensor y = moe_experts(Variable(x, false), Variable(w1, false), Variable(w3, false),
                               Variable(w2, false), route)
                       .value();
  for (int64_t t = 0; t < N; ++t) {
    std::vector<double> p(static_cast<size_t>(E));
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += p[e] = std::exp(double(logits.f32()[t * E + e]));
    std::vector<int64_t> by(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) by[e] = e;
    std::sort(by.begin(), by.end(), [&](int64_t a, int64_t b) { return p[a] > p[b]; });
    const double chosen = p[by[0]] + p[by[1]];
    for (int64_t c = 0; c < C; ++c) {
      double want = 0;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t e = by[j];
        EXPECT_EQ(route.experts.i32()[t * k + j], e);
        want += p[e] / chosen * expert_output(x, w1, w3, w2, t, e, c);
      }
      EXPECT_NEAR(y.f32()[t * C + c], want, 1e-4 * (1 + std::abs(want)));
    }
  }
}

// The experts' products as one parallel pass (one expert a thread, an expert with more than its
// share of rows split by output columns) against the same products on one thread, FP32 and bf16:
// a router that sends every token to expert 0 (its rows split on three threads), odd sizes past
// the split's 64 columns; the output and every gradient (x, the three expert tensors, the
// logits). The output is also the formulas' at a few tokens.
TEST(MoeOps, OneParallelPassIsTheProductsOnOneThread) {
  const int64_t N = 40, C = 130, F = 200, E = 8, k = 2;
  std::mt19937 rng(96);
  const Tensor x = random_tensor(Shape{1, N, C}, rng),
               w1 = random_tensor(Shape{E, F, C}, rng, 0.1f),
               w3 = random_tensor(Shape{E, F, C}, rng, 0.1f),
               w2 = random_tensor(Shape{E, C, F}, rng, 0.1f),
               dy = random_tensor(Shape{1, N, C}, rng);
  Tensor logits = random_tensor(Shape{1, N, E}, rng);
  for (int64_t t = 0; t < N; ++t) logits.f32()[t * E] += 8.0f;
  struct Result {
    std::vector<std::vector<float>> values;  // y, dx, dw1, dw3, dw2, dlogits
  };
  const auto run = [&](int threads, bool bf16) {
    const int previous = omp_get_max_threads();
    omp_set_num_threads(threads);
    ComputeDTypeGuard dtype(bf16 ? DType::BF16 : DType::F32);
    Variable vx(x, true), v1(w1, true), v3(w3, true), v2(w2, true), vl(logits, true);
    const MoeRouting route = moe_route(vl, k, kernels::MoeGating::Softmax, true);
    const Variable y = moe_experts(vx, v1, v3, v2, route);
    backward(y, dy);
    omp_set_num_threads(previous);
    Result r;
    for (const Tensor& t : {y.value(), vx.grad(), v1.grad(), v3.grad(), v2.grad(), vl.grad()})
      r.values.emplace_back(t.f32(), t.f32() + t.numel());
    return r;
  };
  for (const bool bf16 : {false, true}) {
    const Result one = run(1, bf16), three = run(3, bf16);
    for (size_t i = 0; i < one.values.size(); ++i) {
      double top = 0, diff = 0;
      for (size_t j = 0; j < one.values[i].size(); ++j) {
        top = std::max(top, std::abs(double(one.values[i][j])));
        diff = std::max(diff, std::abs(double(one.values[i][j]) - three.values[i][j]));
      }
      EXPECT_GT(top, 0.0) << "result " << i;
      EXPECT_LE(diff, 1e-5 * top) << "result " << i << (bf16 ? " bf16" : " fp32");
    }
    {
      // With w2 and the router frozen the activation is neither kept nor computed again: x's
      // gradient is the same (on one thread, as `one`).
      const int previous = omp_get_max_threads();
      omp_set_num_threads(1);
      ComputeDTypeGuard dtype(bf16 ? DType::BF16 : DType::F32);
      Variable vx(x, true);
      const MoeRouting route =
          moe_route(Variable(logits, false), k, kernels::MoeGating::Softmax, true);
      backward(moe_experts(vx, Variable(w1, true), Variable(w3, true), Variable(w2, false), route),
               dy);
      omp_set_num_threads(previous);
      ASSERT_TRUE(vx.grad().defined());
      for (int64_t j = 0; j < vx.grad().numel(); ++j)
        ASSERT_EQ(vx.grad().f32()[j], one.values[1][static_cast<size_t>(j)]) << j;
    }
    if (bf16) continue;
    for (const int64_t t : {0, 17, 39}) {
      std::vector<double> p(static_cast<size_t>(E));
      for (int64_t e = 0; e < E; ++e) p[e] = std::exp(double(logits.f32()[t * E + e]));
      std::vector<int64_t> by(static_cast<size_t>(E));
      for (int64_t e = 0; e < E; ++e) by[e] = e;
      std::sort(by.begin(), by.end(), [&](int64_t a, int64_t b) { return p[a] > p[b]; });
      ASSERT_EQ(by[0], 0);
      for (int64_t c = 0; c < C; c += 43) {
        double want = 0;
        for (int64_t j = 0; j < k; ++j) {
          const int64_t e = by[j];
          want += p[e] / (p[by[0]] + p[by[1]]) * expert_output(x, w1, w3, w2, t, e, c);
        }
        EXPECT_NEAR(three.values[0][t * C + c], want, 1e-4 * (1 + std::abs(want)));
      }
    }
  }
}

// The router's losses (kernels::MoeRouterLosses): their values, as a MoeLoadCount sums them,
// against the formulas in double, and the gradient a MoeRouterLossScope puts into the logits
// against central differences of the formulas, the choice of experts held by separated logits;
// the output's gradient is zero, so nothing else reaches the logits.
TEST(MoeOps, RouterLossesAreTheFormulasAndTheirGradients) {
  const int64_t N = 9, E = 6, k = 2, C = 4, F = 3;
  const double wb = 0.7, wz = 0.3;
  std::mt19937 rng(97);
  const Tensor logits = separated_logits(N, E, rng);
  const Tensor x = random_tensor(Shape{N, C}, rng), w1 = random_tensor(Shape{E, F, C}, rng),
               w3 = random_tensor(Shape{E, F, C}, rng), w2 = random_tensor(Shape{E, C, F}, rng);
  Tensor dy = random_tensor(Shape{N, C}, rng);
  std::fill_n(dy.f32(), dy.numel(), 0.0f);
  // balance = E sum_e f_e P_e, z = mean lse^2, from logits l (N x E).
  const auto formulas = [&](const std::vector<double>& l, double* balance, double* z) {
    std::vector<double> f(static_cast<size_t>(E), 0.0), P(static_cast<size_t>(E), 0.0);
    *z = 0;
    for (int64_t t = 0; t < N; ++t) {
      double top = l[t * E];
      for (int64_t e = 1; e < E; ++e) top = std::max(top, l[t * E + e]);
      double sum = 0;
      for (int64_t e = 0; e < E; ++e) sum += std::exp(l[t * E + e] - top);
      const double lse = top + std::log(sum);
      *z += lse * lse / N;
      std::vector<int64_t> by(static_cast<size_t>(E));
      for (int64_t e = 0; e < E; ++e) by[e] = e;
      std::stable_sort(by.begin(), by.end(),
                       [&](int64_t a, int64_t b) { return l[t * E + a] > l[t * E + b]; });
      for (int64_t j = 0; j < k; ++j) f[by[j]] += 1.0 / N;
      for (int64_t e = 0; e < E; ++e) P[e] += std::exp(l[t * E + e] - lse) / N;
    }
    *balance = 0;
    for (int64_t e = 0; e < E; ++e) *balance += E * f[e] * P[e];
  };
  Variable vl(logits, true);
  moe_load_take();
  {
    const MoeRouterLossScope scope(static_cast<float>(wb), static_cast<float>(wz));
    Variable y;
    {
      const MoeLoadCount count;
      const MoeRouting route = moe_route(vl, k, kernels::MoeGating::Softmax, true);
      y = moe_experts(Variable(x, false), Variable(w1, false), Variable(w3, false),
                      Variable(w2, false), route);
    }
    backward(y, dy);
  }
  std::vector<double> l(logits.f32(), logits.f32() + N * E);
  double balance = 0, z = 0;
  formulas(l, &balance, &z);
  const std::vector<MoeLoad> loads = moe_load_take();
  ASSERT_EQ(loads.size(), 1u);
  EXPECT_NEAR(loads[0].balance, balance, 1e-5 * balance);
  EXPECT_NEAR(loads[0].z, z, 1e-5 * z);
  EXPECT_GT(balance, 1.0);  // separated logits load the experts unevenly
  ASSERT_TRUE(vl.grad().defined());
  const double h = 1e-4;
  double worst = 0, largest = 0;
  for (int64_t i = 0; i < N * E; ++i) {
    double b1, z1, b2, z2;
    l[i] += h;
    formulas(l, &b1, &z1);
    l[i] -= 2 * h;
    formulas(l, &b2, &z2);
    l[i] += h;
    const double want = (wb * (b1 - b2) + wz * (z1 - z2)) / (2 * h);
    worst = std::max(worst, std::abs(want - vl.grad().f32()[i]));
    largest = std::max(largest, std::abs(want));
  }
  EXPECT_GT(largest, 1e-3);
  EXPECT_LE(worst, 1e-4 + 1e-3 * largest);
}

TEST(OpsGradient, LayerNorm) {
  std::mt19937 rng(63);
  check_gradients([](const auto& v) { return layernorm(v[0], v[1], v[2], 1e-5f); },
                  {random_tensor(Shape{3, 5, 9}, rng, 2.0f), random_tensor(Shape{9}, rng),
                   random_tensor(Shape{9}, rng)},
                  5e-3);
}

// RMSNorm of weights held less 1, whole and per head.
TEST(OpsGradient, RmsNormPlusOne) {
  std::mt19937 rng(64);
  check_gradients([](const auto& v) { return rmsnorm(v[0], v[1], 1e-6f, 1.0f); },
                  {random_tensor(Shape{3, 5, 9}, rng), random_tensor(Shape{9}, rng, 0.3f)}, 5e-3);
  check_gradients([](const auto& v) { return head_rmsnorm(v[0], v[1], 1e-6f, 1.0f); },
                  {random_tensor(Shape{2, 3, 4 * 6}, rng), random_tensor(Shape{6}, rng, 0.3f)},
                  5e-3);
}

TEST(OpsGradient, Add) {
  std::mt19937 rng(7);
  check_gradients([](const auto& v) { return add(v[0], v[1]); },
                  {random_tensor(Shape{4, 5}, rng), random_tensor(Shape{4, 5}, rng)}, 1e-3);
}

// The fused op: every input's gradient by finite differences, and the composed op's values.
TEST(OpsGradient, LoraLinear) {
  std::mt19937 rng(29);
  const std::vector<Tensor> inputs = {random_tensor(Shape{2, 3, 7}, rng),
                                      random_tensor(Shape{5, 7}, rng), random_tensor(Shape{5}, rng),
                                      random_tensor(Shape{2, 7}, rng),
                                      random_tensor(Shape{5, 2}, rng)};
  check_gradients([](const auto& v) { return lora_linear(v[0], v[1], v[2], v[3], v[4], 0.75f); },
                  inputs, 2e-3);
  check_gradients(
      [](const auto& v) { return lora_linear(v[0], v[1], Variable(), v[2], v[3], -1.5f); },
      {inputs[0], inputs[1], inputs[3], inputs[4]}, 2e-3);
  // Two uses of one adapter: the second's gradients accumulate into the first's.
  check_gradients(
      [](const auto& v) {
        return add(lora_linear(v[0], v[1], v[2], v[3], v[4], 0.75f),
                   lora_linear(v[0], v[1], v[2], v[3], v[4], -0.5f));
      },
      inputs, 2e-3);
  // The values: x W' + b + 0.75 (x A') B', from linear's products.
  NoGradGuard no_grad;
  const auto var = [&](size_t i) { return Variable(inputs[i], false); };
  const Tensor fused = lora_linear(var(0), var(1), var(2), var(3), var(4), 0.75f).value();
  const Tensor base = linear(var(0), var(1), var(2)).value();
  const Tensor update = linear(linear(var(0), var(3)), var(4)).value();
  for (int64_t i = 0; i < fused.numel(); ++i)
    EXPECT_NEAR(fused.f32()[i], base.f32()[i] + 0.75f * update.f32()[i], 1e-5) << i;
}

// Dropout on the update's input: gradients by finite differences under one mask (a function of
// the seed); with W 0, A and B identities, the output is s x masked: about p of it zero, the
// rest x / (1 - p) s; the same seed the same mask, another seed another.
TEST(OpsGradient, LoraLinearDropout) {
  std::mt19937 rng(31);
  check_gradients(
      [](const auto& v) { return lora_linear(v[0], v[1], v[2], v[3], v[4], 0.75f, 0.3f, 7); },
      {random_tensor(Shape{2, 3, 7}, rng), random_tensor(Shape{5, 7}, rng),
       random_tensor(Shape{5}, rng), random_tensor(Shape{2, 7}, rng),
       random_tensor(Shape{5, 2}, rng)},
      2e-3);
  NoGradGuard no_grad;
  const int64_t M = 400, K = 8;
  const Tensor x = random_tensor(Shape{M, K}, rng);
  Tensor w = Tensor::zeros(Shape{K, K}, DType::F32, MemoryCategory::Workspace);
  Tensor eye = Tensor::zeros(Shape{K, K}, DType::F32, MemoryCategory::Workspace);
  for (int64_t i = 0; i < K; ++i) eye.f32()[i * K + i] = 1.0f;
  const auto run = [&](uint64_t seed) {
    return lora_linear(Variable(x, false), Variable(w, false), Variable(), Variable(eye, false),
                       Variable(eye, false), 2.0f, 0.25f, seed)
        .value();
  };
  const Tensor a = run(11), b = run(11), c = run(12);
  int64_t zeros = 0, differ = 0;
  for (int64_t i = 0; i < M * K; ++i) {
    EXPECT_EQ(a.f32()[i], b.f32()[i]);
    differ += a.f32()[i] != c.f32()[i];
    if (a.f32()[i] == 0.0f) {
      ++zeros;
    } else {
      EXPECT_NEAR(a.f32()[i], x.f32()[i] * 2.0f / 0.75f, 1e-5);
    }
  }
  EXPECT_NEAR(static_cast<double>(zeros) / (M * K), 0.25, 0.03);
  EXPECT_GT(differ, M * K / 4);
}

TEST(OpsGradient, CrossEntropy) {
  std::mt19937 rng(8);
  Tensor targets = Tensor::empty(Shape{6}, DType::I32, MemoryCategory::Workspace);
  for (int i = 0; i < 6; ++i) targets.i32()[i] = (i * 7 + 3) % 13;
  check_gradients([&](const auto& v) { return cross_entropy(v[0], targets); },
                  {random_tensor(Shape{2, 3, 13}, rng, 2.0f)}, 5e-3);
}

// The fused LM head and loss in chunks of 2 rows over 5 rows (a short last chunk), with an
// output gradient that is not 1.
TEST(OpsGradient, LmHeadCrossEntropyInChunks) {
  std::mt19937 rng(12);
  Tensor targets = Tensor::empty(Shape{5}, DType::I32, MemoryCategory::Workspace);
  for (int i = 0; i < 5; ++i) targets.i32()[i] = (i * 5 + 2) % 13;
  check_gradients([&](const auto& v) { return lm_head_cross_entropy(v[0], v[1], targets, 2); },
                  {random_tensor(Shape{1, 5, 7}, rng), random_tensor(Shape{13, 7}, rng)}, 5e-3);
}

// With the head's bias (Phi-2's): x's, w's and b's gradients, over chunks and a row without a
// target; and the loss that of linear with the bias, then cross-entropy.
TEST(OpsGradient, LmHeadCrossEntropyWithBias) {
  std::mt19937 rng(26);
  Tensor targets = Tensor::empty(Shape{5}, DType::I32, MemoryCategory::Workspace);
  for (int i = 0; i < 5; ++i) targets.i32()[i] = i == 3 ? -1 : (i * 5 + 2) % 13;
  check_gradients(
      [&](const auto& v) { return lm_head_cross_entropy(v[0], v[1], targets, 2, 0, v[2]); },
      {random_tensor(Shape{1, 5, 7}, rng), random_tensor(Shape{13, 7}, rng),
       random_tensor(Shape{13}, rng)},
      5e-3);
  Tensor all = Tensor::empty(Shape{5}, DType::I32, MemoryCategory::Workspace);
  for (int i = 0; i < 5; ++i) all.i32()[i] = (i * 5 + 2) % 13;
  const Variable x(random_tensor(Shape{1, 5, 7}, rng), false);
  const Variable w(random_tensor(Shape{13, 7}, rng), false),
      b(random_tensor(Shape{13}, rng), false);
  const float fused = lm_head_cross_entropy(x, w, all, 2, 0, b).value().f32()[0];
  const float plain = cross_entropy(linear(x, w, b), all).value().f32()[0];
  EXPECT_NEAR(fused, plain, 1e-6f);
}

// Soft-capped logits (Gemma 2's final 30, here 1.5 so the tanh bends): every gradient by finite
// differences, and the loss that of the capped logits.
TEST(OpsGradient, LmHeadCrossEntropySoftCapped) {
  std::mt19937 rng(28);
  Tensor targets = Tensor::empty(Shape{5}, DType::I32, MemoryCategory::Workspace);
  for (int i = 0; i < 5; ++i) targets.i32()[i] = i == 1 ? -1 : (i * 3 + 1) % 13;
  check_gradients(
      [&](const auto& v) {
        return lm_head_cross_entropy(v[0], v[1], targets, 2, 0, Variable(), 1.5f);
      },
      {random_tensor(Shape{1, 5, 7}, rng, 2.0f), random_tensor(Shape{13, 7}, rng)}, 5e-3);
  Tensor all = Tensor::empty(Shape{5}, DType::I32, MemoryCategory::Workspace);
  for (int i = 0; i < 5; ++i) all.i32()[i] = (i * 3 + 1) % 13;
  const Variable x(random_tensor(Shape{1, 5, 7}, rng, 2.0f), false);
  const Variable w(random_tensor(Shape{13, 7}, rng), false);
  Tensor logits = linear(x, w).value();
  kernels::logit_soft_cap(logits.f32(), logits.numel(), 1.5f);
  const float fused = lm_head_cross_entropy(x, w, all, 2, 0, Variable(), 1.5f).value().f32()[0];
  const float plain = cross_entropy(Variable(logits, false), all).value().f32()[0];
  EXPECT_NEAR(fused, plain, 1e-6f);
}

// Rows without a target (below 0) carry no loss and no gradient; the loss divides by the
// targets there are, or by a given normalizer.
TEST(OpsGradient, LmHeadCrossEntropyIgnoresRowsWithoutTargets) {
  std::mt19937 rng(25);
  Tensor targets = Tensor::empty(Shape{6}, DType::I32, MemoryCategory::Workspace);
  const int32_t values[6] = {3, -1, 7, -1, -1, 11};
  std::copy_n(values, 6, targets.i32());
  for (const int64_t normalizer : {0, 10})
    check_gradients(
        [&](const auto& v) { return lm_head_cross_entropy(v[0], v[1], targets, 4, normalizer); },
        {random_tensor(Shape{1, 6, 7}, rng), random_tensor(Shape{13, 7}, rng)}, 5e-3);
  // The loss: the three rows' mean, or their sum over 10; the others' x rows get no gradient.
  const Tensor x0 = random_tensor(Shape{1, 6, 7}, rng), w0 = random_tensor(Shape{13, 7}, rng);
  Tensor kept = Tensor::empty(Shape{3}, DType::I32, MemoryCategory::Workspace);
  const int32_t kept_values[3] = {3, 7, 11};
  std::copy_n(kept_values, 3, kept.i32());
  Tensor x3 = Tensor::empty(Shape{1, 3, 7}, DType::F32, MemoryCategory::Workspace);
  for (int r = 0, k = 0; r < 6; ++r)
    if (values[r] >= 0) std::copy_n(x0.f32() + r * 7, 7, x3.f32() + 7 * k++);
  const float mean3 =
      lm_head_cross_entropy(Variable(x3, false), Variable(w0, false), kept).value().f32()[0];
  Variable x(x0, true), w(w0, false);
  Variable loss = lm_head_cross_entropy(x, w, targets, 4, 10);
  EXPECT_NEAR(loss.value().f32()[0], mean3 * 3.0f / 10.0f, 1e-6);
  EXPECT_NEAR(lm_head_cross_entropy(Variable(x0, false), w, targets).value().f32()[0], mean3, 1e-6);
  backward(loss);
  for (int r = 0; r < 6; ++r)
    for (int c = 0; c < 7; ++c)
      if (values[r] < 0) {
        EXPECT_EQ(x.grad().f32()[r * 7 + c], 0.0f) << r;
      }
}

// It computes what linear then cross_entropy compute: the same loss, and gradients within
// rounding, for any chunk size and output gradient.
TEST(OpsGradient, LmHeadCrossEntropyMatchesLinearThenCrossEntropy) {
  std::mt19937 rng(13);
  const Tensor x0 = random_tensor(Shape{2, 9, 16}, rng), w0 = random_tensor(Shape{37, 16}, rng);
  Tensor targets = Tensor::empty(Shape{18}, DType::I32, MemoryCategory::Workspace);
  for (int i = 0; i < 18; ++i) targets.i32()[i] = (i * 11 + 4) % 37;
  auto run = [&](int64_t chunk, float dy, std::vector<float>* grads) {
    Variable x(x0, true), w(w0, true);
    const Variable loss = chunk < 0 ? cross_entropy(linear(x, w), targets)
                                    : lm_head_cross_entropy(x, w, targets, chunk);
    backward(loss, dy);
    grads->assign(x.grad().f32(), x.grad().f32() + x.grad().numel());
    grads->insert(grads->end(), w.grad().f32(), w.grad().f32() + w.grad().numel());
    return loss.value().f32()[0];
  };
  for (float dy : {1.0f, 0.3f}) {
    std::vector<float> want, got;
    const float want_loss = run(-1, dy, &want);
    for (int64_t chunk : {0, 1, 4, 18, 100}) {
      const float loss = run(chunk, dy, &got);
      EXPECT_NEAR(loss, want_loss, 1e-6f * std::abs(want_loss)) << chunk;
      double max_diff = 0.0, max_ref = 0.0;
      for (size_t i = 0; i < want.size(); ++i) {
        max_diff = std::max(max_diff, std::abs(static_cast<double>(got[i]) - want[i]));
        max_ref = std::max(max_ref, std::abs(static_cast<double>(want[i])));
      }
      EXPECT_GT(max_ref, 0.0);
      EXPECT_LT(max_diff / max_ref, 1e-5) << "chunk " << chunk << " dy " << dy;
    }
  }
}

TEST(OpsGradient, Embedding) {
  std::mt19937 rng(9);
  Tensor tokens = Tensor::empty(Shape{2, 5}, DType::I32, MemoryCategory::Workspace);
  // Token 3 repeats, so the scatter-add of the backward is exercised.
  const int32_t ids[] = {3, 1, 3, 0, 6, 3, 2, 6, 5, 1};
  for (int i = 0; i < 10; ++i) tokens.i32()[i] = ids[i];
  check_gradients([&](const auto& v) { return embedding(v[0], tokens); },
                  {random_tensor(Shape{7, 4}, rng)}, 1e-3);
  // Scaled rows (Gemma's sqrt(C)).
  check_gradients([&](const auto& v) { return embedding(v[0], tokens, 2.0f); },
                  {random_tensor(Shape{7, 4}, rng)}, 1e-3);
}

// A small composition through every op, as a block of the model uses them, so gradients that
// flow through shared inputs (x feeds q, k, v and the residual) are summed correctly.
TEST(OpsGradient, ComposedBlock) {
  std::mt19937 rng(10);
  const int64_t B = 2, T = 5, H = 2, D = 4, C = H * D, F = 6;
  Tensor table = Tensor::empty(Shape{T, D / 2, 2}, DType::F32, MemoryCategory::Workspace);
  kernels::rope_table(table.f32(), T, D, 10000.0);
  auto block = [&](const std::vector<Variable>& v) {
    const Variable& x = v[0];
    Variable h = rmsnorm(x, v[1], 1e-5f);
    Variable q = rope(linear(h, v[2]), table, H, false);
    Variable k = rope(linear(h, v[3]), table, H, false);
    Variable a = add(x, linear(attention(q, k, linear(h, v[4]), H, H), v[5]));
    Variable g = rmsnorm(a, v[6], 1e-5f);
    return add(a, linear(swiglu(linear(g, v[7]), linear(g, v[8])), v[9]));
  };
  check_gradients(block,
                  {random_tensor(Shape{B, T, C}, rng), random_tensor(Shape{C}, rng),
                   random_tensor(Shape{C, C}, rng, 0.5f), random_tensor(Shape{C, C}, rng, 0.5f),
                   random_tensor(Shape{C, C}, rng, 0.5f), random_tensor(Shape{C, C}, rng, 0.5f),
                   random_tensor(Shape{C}, rng), random_tensor(Shape{F, C}, rng, 0.5f),
                   random_tensor(Shape{F, C}, rng, 0.5f), random_tensor(Shape{C, F}, rng, 0.5f)},
                  1e-2, 5e-3f);
}

TEST(Autograd, TapeIsEmptiedAndNoGradRecordsNothing) {
  std::mt19937 rng(11);
  Variable x(random_tensor(Shape{3, 4}, rng), true);
  Variable w(random_tensor(Shape{2, 4}, rng), true);
  {
    NoGradGuard no_grad;
    Variable y = linear(x, w);
    EXPECT_FALSE(y.requires_grad());
    EXPECT_EQ(tape_size(), 0u);
  }
  Variable y = linear(x, w);
  EXPECT_EQ(tape_size(), 1u);
  backward(y, random_tensor(Shape{3, 2}, rng));
  EXPECT_EQ(tape_size(), 0u);
  EXPECT_TRUE(x.grad().defined());
}

TEST(Autograd, ActivationsAreFreedByBackward) {
  std::mt19937 rng(12);
  Variable x(random_tensor(Shape{4, 8}, rng), true);
  Variable w(random_tensor(Shape{8, 8}, rng), true);
  const int64_t before = memory_stats().live_bytes[static_cast<int>(MemoryCategory::Activations)];
  {
    Variable y =
        rmsnorm(linear(linear(x, w), w), Variable(random_tensor(Shape{8}, rng), false), 1e-5f);
    EXPECT_GT(memory_stats().live_bytes[static_cast<int>(MemoryCategory::Activations)], before);
    backward(y, random_tensor(Shape{4, 8}, rng));
  }
  EXPECT_EQ(memory_stats().live_bytes[static_cast<int>(MemoryCategory::Activations)], before);
}

// A checkpoint region inside a larger graph: its input is also used outside it (so its
// gradient accumulates from both), and a weight is used only inside it.
TEST(OpsGradient, CheckpointRegion) {
  std::mt19937 rng(11);
  check_gradients(
      [](const auto& v) {
        const Variable w = v[1], gain = v[2];
        Variable inner = checkpoint(
            [w, gain](const Variable& in) {
              return swiglu(linear(in, w), rmsnorm(in, gain, 1e-5f));
            },
            v[0]);
        return add(inner, v[0]);
      },
      {random_tensor(Shape{2, 5, 6}, rng), random_tensor(Shape{6, 6}, rng),
       random_tensor(Shape{6}, rng)},
      2e-3);
}

TEST(Autograd, CheckpointKeepsOnlyItsInputUntilBackward) {
  std::mt19937 rng(12);
  const Tensor xt = random_tensor(Shape{4, 8, 16}, rng), wt = random_tensor(Shape{16, 16}, rng);
  Variable w(wt, true);
  const auto live = [] {
    return memory_stats().live_bytes[static_cast<int>(MemoryCategory::Activations)];
  };
  const int64_t before = live();
  {
    Variable x(xt, true);
    Variable y = checkpoint(
        [w](const Variable& in) { return linear(swiglu(linear(in, w), linear(in, w)), w); }, x);
    EXPECT_EQ(tape_size(), 1u);
    EXPECT_EQ(live() - before, y.value().bytes());  // x is a leaf, not an activation
    backward(y, random_tensor(y.shape(), rng));
    EXPECT_EQ(tape_size(), 0u);
    EXPECT_TRUE(x.grad().defined());
    EXPECT_TRUE(w.grad().defined());
  }
  EXPECT_EQ(live(), before);
}

}  // namespace
}  // namespace cputrain
