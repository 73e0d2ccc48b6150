// The preference step over packed pairs: pairs packed into shared rows give the loss and
// gradients of one pair a row (attention kept within each sequence), a step accumulated over
// micro-batches gives the loss, gradient norm and figures of one batch of the same rows, and the
// reference pass sums each example's targets as the step does.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <utility>
#include <vector>

#include "adapter_test_util.h"
#include "engine/core/autograd.h"
#include "engine/data/preference_data.h"
#include "engine/train/trainer.h"
#include "models/decoder.h"
#include "models/model_config.h"
#include "models/preference_step.h"

namespace cputrain {
namespace {

constexpr int64_t kCtx = 64;

ModelConfig shape() {
  ModelConfig c = find_preset("tiny")->config;
  c.ctx = kCtx;
  return c;
}

// Four pairs: a prompt shared by the two completions, lengths that differ, random tokens.
std::vector<FinetuneExample> pairs(int64_t vocab) {
  std::mt19937 rng(3);
  std::vector<FinetuneExample> examples;
  const int64_t prompts[] = {5, 9, 3, 7}, chosen[] = {6, 11, 4, 9}, rejected[] = {8, 5, 10, 6};
  for (int p = 0; p < 4; ++p) {
    std::vector<int32_t> prompt(static_cast<size_t>(prompts[p]));
    for (int32_t& t : prompt) t = static_cast<int32_t>(rng() % vocab);
    for (const int64_t n : {chosen[p], rejected[p]}) {
      FinetuneExample e;
      e.tokens = prompt;
      e.target.assign(prompt.size(), 0);
      for (int64_t i = 0; i < n; ++i) {
        e.tokens.push_back(static_cast<int32_t>(rng() % vocab));
        e.target.push_back(1);
      }
      examples.push_back(std::move(e));
    }
  }
  return examples;
}

DecoderModel adapted_model() {
  ModelOptions o;
  o.lora.rank = 4;
  o.lora.alpha = 8.0;
  o.lora.targets.fill(true);
  DecoderModel m(shape(), o);
  m.init_weights(5);
  m.init_adapters(6);
  // Adapters away from their zero start, so the policy differs from the reference.
  std::mt19937 rng(7);
  test::draw_adapter_b(m.parameters(), rng);
  return m;
}

std::vector<const PackedRow*> pointers(const std::vector<PackedRow>& rows) {
  std::vector<const PackedRow*> all;
  for (const PackedRow& r : rows) all.push_back(&r);
  return all;
}

double chosen_tokens(const std::vector<FinetuneExample>& examples) {
  double n = 0.0;
  for (size_t i = 0; i < examples.size(); i += 2)
    n += static_cast<double>(
        std::count(examples[i].target.begin() + 1, examples[i].target.end(), 1));
  return n;
}

TEST(PreferenceStep, PackedPairsGiveTheLossAndGradientsOfAPairARow) {
  DecoderModel model = adapted_model();
  const std::vector<FinetuneExample> examples = pairs(model.config().vocab);
  model.set_adapters_enabled(false);
  std::vector<PackedRow> one_a_row;  // filled below, then read only
  for (int32_t p = 0; p < 4; ++p)
    one_a_row.push_back({{2 * p, 2 * p + 1},
                         std::ssize(examples[static_cast<size_t>(2 * p)].tokens) +
                             std::ssize(examples[static_cast<size_t>(2 * p + 1)].tokens) - 2});
  const std::vector<PackedRow> packed = pack_pairs(examples, kCtx);
  ASSERT_LT(packed.size(), one_a_row.size());  // some pairs share a row
  const std::vector<double> reference = sequence_log_probs(model, packed, examples, kCtx, 2, 0);
  // Other rows beside them, other batches: the same sums to float rounding (a GEMM may sum
  // in another order for another count of rows).
  const std::vector<double> alone = sequence_log_probs(model, one_a_row, examples, kCtx, 3, 0);
  ASSERT_EQ(alone.size(), reference.size());
  for (size_t i = 0; i < alone.size(); ++i)
    EXPECT_NEAR(alone[i], reference[i], 1e-5 * std::abs(reference[i])) << i;
  model.set_adapters_enabled(true);
  for (const PreferenceMethod method : {PreferenceMethod::Dpo, PreferenceMethod::Orpo}) {
    PreferenceBatches b;
    b.examples = &examples;
    b.loss.method = method;
    if (method == PreferenceMethod::Dpo) b.reference = reference;
    std::vector<std::vector<float>> grads;
    std::vector<float> losses;
    for (const std::vector<PackedRow>* rows : {&packed, &std::as_const(one_a_row)}) {
      const auto n = std::ssize(*rows);
      const Tensor inputs = Tensor::empty(Shape{n, kCtx}, DType::I32, MemoryCategory::Workspace);
      const Tensor targets = Tensor::empty(Shape{n, kCtx}, DType::I32, MemoryCategory::Workspace);
      ParameterSet& p = model.parameters();
      p.zero_grad();
      PreferenceStats stats;
      b.stats = &stats;
      const Variable loss = preference_batch_loss(model, pointers(*rows), b, 0, inputs, targets,
                                                  4.0, chosen_tokens(examples));
      backward(loss);
      EXPECT_EQ(stats.pairs, 4.0);
      losses.push_back(loss.value().f32()[0]);
      grads.emplace_back(p.gradients().f32(), p.gradients().f32() + p.trainable_numel());
      // The loss from the sums of a pass without gradients.
      const std::vector<double> logps = sequence_log_probs(model, *rows, examples, kCtx, n, 0);
      EXPECT_NEAR(preference_loss_of(logps, examples, b.reference, b.loss, nullptr), losses.back(),
                  1e-6 * std::abs(losses.back()));
    }
    EXPECT_NEAR(losses[0], losses[1], 1e-6 * std::abs(losses[1]));
    double diff = 0.0, scale = 0.0;
    for (size_t i = 0; i < grads[0].size(); ++i) {
      diff = std::max(diff, static_cast<double>(std::abs(grads[0][i] - grads[1][i])));
      scale = std::max(scale, static_cast<double>(std::abs(grads[1][i])));
    }
    EXPECT_GT(scale, 0.0);
    EXPECT_LT(diff / scale, 1e-5);
  }
}

TEST(PreferenceStep, AccumulationGivesTheStepOfOneBatch) {
  for (const PreferenceMethod method : {PreferenceMethod::Dpo, PreferenceMethod::Orpo}) {
    std::vector<double> losses, norms;
    std::vector<PreferenceStats> figures;
    for (const int64_t batch : {2, 1}) {
      DecoderModel model = adapted_model();
      const std::vector<FinetuneExample> examples = pairs(model.config().vocab);
      const std::vector<PackedRow> rows = pack_pairs(examples, 50);  // two pairs a row
      ASSERT_EQ(rows.size(), 2u);
      model.set_adapters_enabled(false);
      const std::vector<double> reference = sequence_log_probs(model, rows, examples, 50, 2, 0);
      model.set_adapters_enabled(true);
      TrainOptions t;
      t.batch = batch;
      t.accum = 2 / batch;
      t.ctx = 50;
      t.lr = {1e-3, 0, 1, 0.0};
      Trainer trainer(model.parameters(), nullptr, t);
      PreferenceStats stats;
      PreferenceBatches b{&examples, reference, {method, 0.1, 0.1}, &stats};
      if (method == PreferenceMethod::Orpo) b.reference = {};
      const Tensor inputs = Tensor::empty(Shape{batch, 50}, DType::I32, MemoryCategory::Workspace);
      const Tensor targets = Tensor::empty(Shape{batch, 50}, DType::I32, MemoryCategory::Workspace);
      const StepResult r =
          preference_step(trainer, model, 1, pointers(rows), b, 0, inputs, targets);
      losses.push_back(r.loss);
      norms.push_back(r.grad_norm);
      figures.push_back(stats);
    }
    EXPECT_NEAR(losses[0], losses[1], 1e-6 * losses[0]);
    EXPECT_NEAR(norms[0], norms[1], 1e-5 * norms[0]);
    EXPECT_GT(norms[0], 0.0);
    EXPECT_EQ(figures[0].pairs, 4.0);
    EXPECT_EQ(figures[1].pairs, 4.0);
    EXPECT_NEAR(figures[0].reward_chosen, figures[1].reward_chosen, 1e-6);
    EXPECT_NEAR(figures[0].logp_rejected, figures[1].logp_rejected, 1e-4);
  }
}

}  // namespace
}  // namespace cputrain
