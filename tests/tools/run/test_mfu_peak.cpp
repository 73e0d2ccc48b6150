// The MFU's peak: measured again where a step runs near or above it, the best kept, and no MFU
// for a step above the peak.
#include <gtest/gtest.h>

#include <vector>

#include "tools/run/mfu_peak.h"

namespace cputrain {
namespace {

TEST(MfuPeak, MeasuredAgainWhereAStepRunsNearTheStartUpPeak) {
  std::vector<double> measurements = {235.0, 469.0};  // the second longer measurement is right
  int calls = 0;
  MfuPeak peak(234.0, [&] { return measurements[calls++]; });
  // A step at 287 GFLOP/s over a 234 peak: measured again, still low; no MFU for that step.
  EXPECT_TRUE(peak.update(287.0));
  EXPECT_EQ(calls, 1);
  EXPECT_DOUBLE_EQ(peak.gflops(), 235.0);
  EXPECT_FALSE(peak.mfu(287.0).has_value());
  // The next step at 284: measured again, now 469.
  EXPECT_TRUE(peak.update(284.0));
  EXPECT_EQ(calls, 2);
  EXPECT_DOUBLE_EQ(peak.gflops(), 469.0);
  ASSERT_TRUE(peak.mfu(284.0).has_value());
  EXPECT_DOUBLE_EQ(*peak.mfu(284.0), 284.0 / 469.0);
  // Steps below 90% of it measure nothing more.
  EXPECT_FALSE(peak.update(0.9 * 469.0));
  EXPECT_EQ(calls, 2);
}

TEST(MfuPeak, KeepsTheBestMeasurement) {
  MfuPeak peak(400.0, [] { return 300.0; });  // a lower second measurement is not taken
  EXPECT_TRUE(peak.update(390.0));
  EXPECT_DOUBLE_EQ(peak.gflops(), 400.0);
  EXPECT_DOUBLE_EQ(*peak.mfu(390.0), 390.0 / 400.0);
}

TEST(MfuPeak, NoPeakNoMfu) {
  int calls = 0;
  MfuPeak peak(0.0, [&] {
    ++calls;
    return 100.0;
  });
  EXPECT_FALSE(peak.update(50.0));
  EXPECT_EQ(calls, 0);
  EXPECT_FALSE(peak.mfu(50.0).has_value());
}

}  // namespace
}  // namespace cputrain
