// DPO's and ORPO's pair terms: their values where they are known in closed form, their
// derivatives by the two sums against central differences, and the figures of a set of pairs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "engine/train/preference_loss.h"

namespace cputrain {
namespace {

// Pairs over a range of scores: far apart either way, close, long and short completions.
const PairScores kPairs[] = {{-12.0, -15.0, 6, 7, -13.0, -14.0},
                             {-40.0, -10.0, 20, 5, -42.0, -11.0},
                             {-3.0, -3.0, 3, 3, -3.5, -2.5},
                             {-0.2, -9.0, 4, 9, -0.1, -8.0},
                             {-80.0, -81.0, 40, 41, -60.0, -90.0}};

TEST(PreferenceLoss, KnownValues) {
  PreferenceLossOptions dpo;
  dpo.beta = 0.5;
  // Policy and reference alike: the log-ratios are 0 and the loss log 2.
  PairTerm t = preference_pair({-5.0, -7.0, 3, 4, -5.0, -7.0}, dpo);
  EXPECT_NEAR(t.loss, std::log(2.0), 1e-15);
  EXPECT_NEAR(t.d_chosen, -0.25, 1e-15);  // -beta sigmoid(0)
  EXPECT_NEAR(t.d_rejected, 0.25, 1e-15);
  EXPECT_EQ(t.reward_chosen, 0.0);
  // Chosen up by 2 nats against the reference, rejected down by 2: h = 0.5 * 4 = 2.
  t = preference_pair({-3.0, -9.0, 3, 4, -5.0, -7.0}, dpo);
  EXPECT_NEAR(t.loss, std::log1p(std::exp(-2.0)), 1e-15);
  EXPECT_NEAR(t.reward_chosen, 1.0, 1e-15);
  EXPECT_NEAR(t.reward_rejected, -1.0, 1e-15);

  PreferenceLossOptions orpo;
  orpo.method = PreferenceMethod::Orpo;
  orpo.lambda = 0.25;
  // Equal means: the odds ratio is 1 and the term lambda log 2.
  t = preference_pair({-6.0, -4.0, 3, 2}, orpo);
  EXPECT_NEAR(t.log_odds, 0.0, 1e-15);
  EXPECT_NEAR(t.loss, 0.25 * std::log(2.0), 1e-15);
  // Means log 0.5 and log 0.25: odds 1 and 1/3.
  t = preference_pair({2.0 * std::log(0.5), 3.0 * std::log(0.25), 2, 3}, orpo);
  EXPECT_NEAR(t.log_odds, std::log(3.0), 1e-12);
  EXPECT_NEAR(t.loss, 0.25 * std::log1p(1.0 / 3.0), 1e-12);
  EXPECT_NEAR(t.reward_chosen, 0.25 * std::log(0.5), 1e-15);
}

TEST(PreferenceLoss, DerivativesMatchCentralDifferences) {
  for (const PreferenceMethod method : {PreferenceMethod::Dpo, PreferenceMethod::Orpo}) {
    PreferenceLossOptions o;
    o.method = method;
    o.beta = 0.3;
    o.lambda = 0.7;
    for (const PairScores& p : kPairs) {
      const PairTerm t = preference_pair(p, o);
      const double h = 1e-5;
      PairScores up = p, down = p;
      up.chosen += h;
      down.chosen -= h;
      const double dc = (preference_pair(up, o).loss - preference_pair(down, o).loss) / (2 * h);
      up = down = p;
      up.rejected += h;
      down.rejected -= h;
      const double dr = (preference_pair(up, o).loss - preference_pair(down, o).loss) / (2 * h);
      EXPECT_NEAR(t.d_chosen, dc, 1e-8 + 1e-6 * std::abs(dc)) << p.chosen;
      EXPECT_NEAR(t.d_rejected, dr, 1e-8 + 1e-6 * std::abs(dr)) << p.chosen;
      EXPECT_LT(t.d_chosen, 0.0);  // raising the chosen's likelihood lowers the loss
      EXPECT_GT(t.d_rejected, 0.0);
    }
  }
}

TEST(PreferenceLoss, StatsAreTheMeansOfThePairs) {
  PreferenceLossOptions o;
  PreferenceStats s;
  double margin = 0.0, correct = 0.0, loss = 0.0;
  for (const PairScores& p : kPairs) {
    const PairTerm t = preference_pair(p, o);
    s.add(t);
    margin += t.reward_chosen - t.reward_rejected;
    correct += t.reward_chosen > t.reward_rejected;
    loss += t.loss;
  }
  PreferenceStats copy;
  copy.set(s.values());
  nlohmann::json line;
  copy.describe(o.method, line, "val_");
  const double n = std::size(kPairs);
  EXPECT_DOUBLE_EQ(line["val_rewards/margins"].get<double>(), margin / n);
  EXPECT_DOUBLE_EQ(line["val_rewards/accuracies"].get<double>(), correct / n);
  EXPECT_DOUBLE_EQ(copy.loss, loss);
  EXPECT_FALSE(line.contains("val_log_odds_ratio"));  // ORPO's alone
  char accuracy[32];
  std::snprintf(accuracy, sizeof accuracy, "accuracy %.2f,", correct / n);
  EXPECT_NE(copy.summary().find(accuracy), std::string::npos) << copy.summary();
}

}  // namespace
}  // namespace cputrain
