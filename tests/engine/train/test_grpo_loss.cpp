// GRPO's token term and advantages: values known in closed form, the derivative by logp against
// central differences on both sides of the clipping, and groups of one.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "engine/train/grpo_loss.h"

namespace cputrain {
namespace {

TEST(GrpoLoss, OnPolicyTermIsMinusTheAdvantage) {
  GrpoLossOptions o;
  // r = 1: the loss is -A and its derivative -A, whatever epsilon.
  for (const double a : {-1.5, 0.0, 0.7}) {
    const GrpoTokenTerm t = grpo_token(-2.0, -2.0, 0.0, a, o);
    EXPECT_DOUBLE_EQ(t.loss, -a);
    EXPECT_DOUBLE_EQ(t.d_logp, -a);
    EXPECT_EQ(t.kl, 0.0);
    EXPECT_FALSE(t.clipped_low || t.clipped_high);
  }
  // The KL to a reference alike is 0, its derivative 0.
  o.beta = 0.5;
  GrpoTokenTerm t = grpo_token(-2.0, -2.0, -2.0, 1.0, o);
  EXPECT_DOUBLE_EQ(t.kl, 0.0);
  EXPECT_DOUBLE_EQ(t.d_logp, -1.0);
  // ref - logp = 1: k3 = e - 2.
  t = grpo_token(-2.0, -2.0, -1.0, 0.0, o);
  EXPECT_NEAR(t.kl, std::exp(1.0) - 2.0, 1e-15);
  EXPECT_NEAR(t.loss, 0.5 * (std::exp(1.0) - 2.0), 1e-15);
}

TEST(GrpoLoss, ClippingTakesTheSmallerTerm) {
  GrpoLossOptions o;
  o.epsilon = 0.2;
  o.epsilon_high = 0.28;
  // r = 1.5 with A > 0: clipped at 1.28, no gradient.
  GrpoTokenTerm t = grpo_token(std::log(1.5), 0.0, 0.0, 2.0, o);
  EXPECT_TRUE(t.clipped_high);
  EXPECT_NEAR(t.loss, -1.28 * 2.0, 1e-12);
  EXPECT_EQ(t.d_logp, 0.0);
  // r = 1.5 with A < 0: the unclipped term is the smaller, its gradient stays.
  t = grpo_token(std::log(1.5), 0.0, 0.0, -2.0, o);
  EXPECT_FALSE(t.clipped_high || t.clipped_low);
  EXPECT_NEAR(t.loss, 1.5 * 2.0, 1e-12);
  EXPECT_NEAR(t.d_logp, 1.5 * 2.0, 1e-12);
  // r = 0.5 with A < 0: clipped at 0.8.
  t = grpo_token(std::log(0.5), 0.0, 0.0, -1.0, o);
  EXPECT_TRUE(t.clipped_low);
  EXPECT_NEAR(t.loss, 0.8, 1e-12);
  EXPECT_EQ(t.d_logp, 0.0);
}

TEST(GrpoLoss, DerivativeMatchesCentralDifferences) {
  GrpoLossOptions o;
  o.beta = 0.04;
  o.epsilon = 0.2;
  o.epsilon_high = 0.28;
  const double h = 1e-6;
  for (const double logp : {-3.0, -1.0, -0.2})
    for (const double shift : {-0.5, -0.1, 0.0, 0.1, 0.4})  // ratios inside and outside the clip
      for (const double a : {-1.2, 0.3, 1.7}) {
        const double old = logp - shift, ref = logp + 0.3;
        const GrpoTokenTerm t = grpo_token(logp, old, ref, a, o);
        const double up = grpo_token(logp + h, old, ref, a, o).loss;
        const double down = grpo_token(logp - h, old, ref, a, o).loss;
        EXPECT_NEAR(t.d_logp, (up - down) / (2 * h), 1e-6) << logp << " " << shift << " " << a;
      }
}

TEST(GrpoLoss, AdvantagesWithinGroups) {
  // Bessel's standard deviation: of {1, 0, 0.5} it is 0.5.
  const std::vector<double> r = {1.0, 0.0, 0.5, 2.0, 2.0, 2.0};
  const std::vector<double> a = group_advantages(r, 3, true);
  EXPECT_NEAR(a[0], 0.5 / (0.5 + 1e-4), 1e-12);
  EXPECT_NEAR(a[1], -0.5 / (0.5 + 1e-4), 1e-12);
  EXPECT_NEAR(a[2], 0.0, 1e-12);
  for (size_t i = 3; i < 6; ++i) EXPECT_EQ(a[i], 0.0);  // all alike: no signal
  const std::vector<double> raw = group_advantages(r, 3, false);
  EXPECT_NEAR(raw[0], 0.5, 1e-12);
  EXPECT_NEAR(mean_group_std(r, 3), 0.25, 1e-12);
  EXPECT_NEAR(zero_std_fraction(r, 3), 0.5, 1e-12);
  // Groups of one: every advantage 0, so an on-policy step has no gradient.
  for (const double v : group_advantages(r, 1, true)) EXPECT_EQ(v, 0.0);
  EXPECT_THROW(group_advantages(r, 4, true), std::invalid_argument);
}

}  // namespace
}  // namespace cputrain
