// AdamW with clipping and decay groups against a double-precision reference; the trainer's
// gradient-accumulation equivalence, learning on a patterned stream, and evaluation.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <vector>

#include "engine/core/autograd.h"
#include "engine/core/ops.h"
#include "engine/train/adamw.h"
#include "engine/train/trainer.h"

namespace cputrain {
namespace {

TEST(AdamW, ClipsGloballyAndDecaysOnlyMarkedParameters) {
  ParameterSet params;
  const int matrix = params.add("matrix", Shape{3, 4}, true);
  const int gain = params.add("gain", Shape{5}, false);
  params.allocate();
  const int64_t offsets[2] = {params.infos()[matrix].offset, params.infos()[gain].offset};
  const int64_t sizes[2] = {12, 5};
  std::vector<double> w[2], m[2], v[2];
  for (int p = 0; p < 2; ++p) {
    for (int64_t i = 0; i < sizes[p]; ++i) {
      params.weights().f32()[offsets[p] + i] = 0.1f * static_cast<float>(i + 1) * (p ? -1 : 1);
      w[p].push_back(params.weights().f32()[offsets[p] + i]);
    }
    m[p].assign(sizes[p], 0.0);
    v[p].assign(sizes[p], 0.0);
  }
  AdamWConfig config;
  AdamW optimizer(params, config);
  const double lr = 0.01;
  for (int step = 1; step <= 4; ++step) {
    // Gradients with a global norm above the clip threshold on odd steps, below it on even.
    double norm_sq = 0.0;
    for (int p = 0; p < 2; ++p)
      for (int64_t i = 0; i < sizes[p]; ++i) {
        const float g = (step % 2 ? 1.0f : 0.01f) * std::sin(static_cast<float>(i + 7 * p + step));
        params.gradients().f32()[offsets[p] + i] = g;
        norm_sq += static_cast<double>(g) * g;
      }
    const double norm = std::sqrt(norm_sq);
    const float got_norm = optimizer.step(static_cast<float>(lr));
    EXPECT_NEAR(got_norm, norm, 1e-6 * norm);
    const double scale = std::min(1.0, 1.0 / (norm + 1e-6));
    const double bc1 = 1 - std::pow(0.9, step), bc2 = 1 - std::pow(0.95, step);
    for (int p = 0; p < 2; ++p)
      for (int64_t i = 0; i < sizes[p]; ++i) {
        const double g = params.gradients().f32()[offsets[p] + i] * scale;
        if (p == 0) w[p][i] *= 1 - lr * 0.1;
        m[p][i] = 0.9 * m[p][i] + 0.1 * g;
        v[p][i] = 0.95 * v[p][i] + 0.05 * g * g;
        w[p][i] -= lr / bc1 * m[p][i] / (std::sqrt(v[p][i]) / std::sqrt(bc2) + 1e-8);
      }
  }
  for (int p = 0; p < 2; ++p)
    for (int64_t i = 0; i < sizes[p]; ++i)
      EXPECT_NEAR(params.weights().f32()[offsets[p] + i], w[p][i], 1e-6) << p << "," << i;
}

// A one-layer language model: logits = embedding(tokens) W^T.
struct TinyModel {
  static constexpr int64_t V = 13, C = 8;
  ParameterSet params;
  int emb = 0, out = 0;
  TinyModel() {
    emb = params.add("emb", Shape{V, C}, true);
    out = params.add("out", Shape{V, C}, true);
    params.allocate();
    for (int64_t i = 0; i < params.weights().numel(); ++i)
      params.weights().f32()[i] = 0.1f * std::sin(static_cast<float>(i) * 1.7f);
  }
  Trainer::LossFn loss_fn() {
    return [this](const Tensor& x, const Tensor& y) {
      return cross_entropy(linear(embedding(params.var(emb), x), params.var(out)), y);
    };
  }
};

std::vector<int32_t> patterned_stream(int64_t n) {
  std::vector<int32_t> tokens(n);
  for (int64_t i = 0; i < n; ++i) tokens[i] = static_cast<int32_t>((i * 5 + i / 7) % 13);
  return tokens;
}

TrainOptions options(int64_t batch, int64_t accum) {
  TrainOptions o;
  o.batch = batch;
  o.accum = accum;
  o.ctx = 16;
  o.seed = 42;
  o.lr.peak = 0.05;
  o.lr.warmup_steps = 2;
  o.lr.total_steps = 10;
  return o;
}

TEST(Trainer, AccumulatedMicroBatchesEqualOneLargeBatch) {
  const std::vector<int32_t> tokens = patterned_stream(500);
  TinyModel a, b;
  Trainer ta(a.params, a.loss_fn(), options(4, 1));
  Trainer tb(b.params, b.loss_fn(), options(2, 2));
  for (int64_t step = 1; step <= 5; ++step) {
    const StepResult ra = ta.step(tokens, step);
    const StepResult rb = tb.step(tokens, step);
    EXPECT_NEAR(ra.loss, rb.loss, 1e-6 * ra.loss) << step;
    EXPECT_NEAR(ra.grad_norm, rb.grad_norm, 1e-5 * ra.grad_norm) << step;
    EXPECT_EQ(ra.lr, rb.lr);
  }
  for (int64_t i = 0; i < a.params.weights().numel(); ++i)
    ASSERT_NEAR(a.params.weights().f32()[i], b.params.weights().f32()[i], 1e-6) << i;
}

TEST(Trainer, LossFallsAndEvaluationRecordsNothing) {
  const std::vector<int32_t> tokens = patterned_stream(2000);
  TinyModel model;
  TrainOptions o = options(4, 1);
  o.lr.total_steps = 60;
  Trainer trainer(model.params, model.loss_fn(), o);
  const double before = trainer.evaluate(tokens, 8);
  StepResult first, last;
  for (int64_t step = 1; step <= 60; ++step) {
    last = trainer.step(tokens, step);
    if (step == 1) first = last;
    EXPECT_GT(last.tokens_per_s, 0.0);
  }
  const double after = trainer.evaluate(tokens, 8);
  EXPECT_LT(last.loss, 0.5 * first.loss);
  EXPECT_LT(after, 0.5 * before);
  EXPECT_EQ(tape_size(), 0u);
  // Evaluation is deterministic and clamps the window count to what the stream holds.
  EXPECT_EQ(trainer.evaluate(tokens, 8), after);
  const std::vector<int32_t> short_stream(tokens.begin(), tokens.begin() + 40);  // 2 windows
  EXPECT_EQ(trainer.evaluate(short_stream, 100), trainer.evaluate(short_stream, 2));
}

}  // namespace
}  // namespace cputrain
