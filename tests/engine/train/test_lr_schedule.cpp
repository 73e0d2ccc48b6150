#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

#include "engine/train/lr_schedule.h"

namespace cputrain {
namespace {

TEST(LrSchedule, WarmupThenCosineToTenPercent) {
  LrSchedule s{1e-3, 10, 110, 0.1};
  EXPECT_DOUBLE_EQ(learning_rate(s, 1), 1e-4);
  EXPECT_DOUBLE_EQ(learning_rate(s, 5), 5e-4);
  EXPECT_DOUBLE_EQ(learning_rate(s, 10), 1e-3);
  // Halfway through the decay the cosine is at its midpoint.
  EXPECT_NEAR(learning_rate(s, 60), 1e-4 + 0.5 * 9e-4, 1e-12);
  const double expected_11 = 1e-4 + 9e-4 * 0.5 * (1.0 + std::cos(std::numbers::pi * 0.01));
  EXPECT_NEAR(learning_rate(s, 11), expected_11, 1e-15);
  EXPECT_NEAR(learning_rate(s, 110), 1e-4, 1e-15);
  EXPECT_NEAR(learning_rate(s, 500), 1e-4, 1e-15);
  for (int64_t step = 11; step < 110; ++step)
    EXPECT_GT(learning_rate(s, step), learning_rate(s, step + 1));
}

TEST(LrSchedule, NoWarmup) {
  LrSchedule s{2e-3, 0, 100, 0.1};
  EXPECT_NEAR(learning_rate(s, 1), 2e-4 + 1.8e-3 * 0.5 * (1.0 + std::cos(std::numbers::pi * 0.01)),
              1e-15);
}

// A schedule that decays to 0 (a fine-tune's) runs the steps past its end, a run extended
// beyond it, at beyond_ratio of the peak; the steps within it are as without.
TEST(LrSchedule, StepsPastTheEndRunAtTheirOwnRatio) {
  LrSchedule s{1e-3, 4, 20, 0.0, 0.1};
  const LrSchedule plain{1e-3, 4, 20, 0.0};
  for (int64_t step = 1; step <= 20; ++step)
    EXPECT_EQ(learning_rate(s, step), learning_rate(plain, step)) << step;
  EXPECT_EQ(learning_rate(plain, 20), 0.0);
  EXPECT_EQ(learning_rate(plain, 21), 0.0);
  EXPECT_DOUBLE_EQ(learning_rate(s, 21), 1e-4);
  EXPECT_DOUBLE_EQ(learning_rate(s, 400), 1e-4);
}

}  // namespace
}  // namespace cputrain
